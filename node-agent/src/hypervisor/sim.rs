//! A hypervisor that runs nothing: it keeps the set of "running" VMs in memory and in
//! `STATE/sim-vms.json`, so a restarted agent still reports them. Its serial port is a
//! stand-in ([`super::sim_serial`]): a login prompt and a line echo, no guest.

use super::sim_serial::{self, Transcripts};
use super::{Hypervisor, HypervisorError, SerialPort, check_devices_ready};
use crate::state::{read_json, write_json};
use passage_model::VmId;
use passage_model::protocol::{Shutdown, VmSpec};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

const STATE_FILE: &str = "sim-vms.json";

pub struct SimHypervisor {
    path: PathBuf,
    sysfs_root: Option<PathBuf>,
    /// Shared with the serial stand-ins, which end when their VM leaves it.
    vms: Arc<Mutex<BTreeMap<VmId, VmSpec>>>,
    /// What each VM's stand-in printed and echoed, for the text console.
    transcripts: Transcripts,
}

impl SimHypervisor {
    pub fn open(state_dir: &Path, sysfs_root: Option<&Path>) -> Result<Self, HypervisorError> {
        let path = state_dir.join(STATE_FILE);
        let list: Vec<VmSpec> = read_json(&path)
            .map_err(|source| HypervisorError::State {
                path: path.clone(),
                source,
            })?
            .unwrap_or_default();
        Ok(SimHypervisor {
            path,
            sysfs_root: sysfs_root.map(Path::to_path_buf),
            vms: Arc::new(Mutex::new(list.into_iter().map(|s| (s.uuid, s)).collect())),
            transcripts: Transcripts::default(),
        })
    }

    fn save(&self, vms: &BTreeMap<VmId, VmSpec>) -> Result<(), HypervisorError> {
        let list: Vec<&VmSpec> = vms.values().collect();
        write_json(&self.path, &list, 0o600).map_err(|source| HypervisorError::State {
            path: self.path.clone(),
            source,
        })
    }

    fn vms(&self) -> std::sync::MutexGuard<'_, BTreeMap<VmId, VmSpec>> {
        self.vms.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Hypervisor for SimHypervisor {
    fn start(&self, spec: &VmSpec) -> Result<(), HypervisorError> {
        let mut vms = self.vms();
        if let Some(running) = vms.get(&spec.uuid) {
            return if running == spec {
                Ok(())
            } else {
                Err(HypervisorError::Conflict { vm: spec.uuid })
            };
        }
        // As QEMU would refuse them, so that a VM placed on a node without its network's
        // bridge fails in fleet tests too. Taps and VLANs are not simulated.
        let nics = match &self.sysfs_root {
            Some(root) => {
                check_devices_ready(root, spec)?;
                crate::net::check_nics(root, &spec.nics, false)
            }
            None => crate::net::validate_nics(&spec.nics),
        };
        nics.map_err(|source| HypervisorError::Network {
            vm: spec.uuid,
            source,
        })?;
        vms.insert(spec.uuid, spec.clone());
        self.save(&vms)
    }

    fn stop(&self, vm: VmId) -> Result<(), HypervisorError> {
        let mut vms = self.vms();
        if vms.remove(&vm).is_some() {
            self.save(&vms)?;
        }
        self.transcripts.forget(vm);
        Ok(())
    }

    /// A simulated guest honours the power button at once.
    fn shutdown(&self, vm: VmId, _grace: std::time::Duration) -> Result<Shutdown, HypervisorError> {
        let mut vms = self.vms();
        if vms.remove(&vm).is_none() {
            return Ok(Shutdown::NotRunning);
        }
        self.save(&vms)?;
        self.transcripts.forget(vm);
        Ok(Shutdown::GuestShutDown { after_ms: 0 })
    }

    /// A boot log made up from the spec, naming what a tenant would look for on a real
    /// console: the VM, its NICs and its host name. Empty once the VM stops: the sim
    /// keeps nothing of a stopped VM.
    fn console(&self, vm: VmId) -> Result<String, HypervisorError> {
        let vms = self.vms();
        let Some(spec) = vms.get(&vm) else {
            return Ok(String::new());
        };
        let mut log = format!(
            "[    0.000000] Linux version 6.1.0-passage-sim (simulated)\n\
             [    0.000000] DMI: Passage simulated VM {vm}\n\
             [    0.010000] {} CPUs, {} MiB, {} passed-through devices\n",
            spec.vcpus,
            spec.memory_mib,
            spec.devices.len()
        );
        for (i, nic) in spec.nics.iter().enumerate() {
            log.push_str(&format!(
                "[    1.200000] eth{i}: {} {}/{} on {}\n",
                nic.mac, nic.ip, nic.prefix_len, nic.bridge
            ));
        }
        let host = spec
            .cloud_init
            .as_ref()
            .map_or("localhost", |c| c.hostname.as_str());
        log.push_str(&format!(
            "cloud-init: instance-id {vm}, hostname {host}\n\n{host} login: "
        ));
        log.push_str(&self.transcripts.get(vm));
        Ok(log)
    }

    fn serial(&self, vm: VmId) -> Result<SerialPort, HypervisorError> {
        let host = match self.vms().get(&vm) {
            Some(spec) => spec
                .cloud_init
                .as_ref()
                .map_or_else(|| "localhost".to_string(), |c| c.hostname.clone()),
            None => return Err(HypervisorError::NotRunning { vm }),
        };
        let runtime =
            tokio::runtime::Handle::try_current().map_err(|_| HypervisorError::Launch {
                vm,
                reason: "the serial stand-in needs the agent's async runtime".to_string(),
            })?;
        let (ours, theirs) = tokio::io::duplex(sim_serial::BUFFER);
        let vms = self.vms.clone();
        let alive = move || {
            vms.lock()
                .unwrap_or_else(|p| p.into_inner())
                .contains_key(&vm)
        };
        runtime.spawn(sim_serial::run(
            ours,
            host,
            alive,
            self.transcripts.writer(vm),
        ));
        Ok(SerialPort::Stream(theirs))
    }

    /// The state file is the sim's truth: a VM removed from it (by a test, as a crash
    /// would remove it) is no longer running.
    fn running(&self) -> Vec<VmId> {
        let mut vms = self.vms();
        if let Ok(Some(list)) = read_json::<Vec<VmSpec>>(&self.path) {
            *vms = list.into_iter().map(|s| (s.uuid, s)).collect();
        }
        vms.keys().copied().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> VmSpec {
        VmSpec {
            uuid: VmId::new_random(),
            vcpus: 4,
            memory_mib: 4096,
            devices: Vec::new(),
            disk: None,
            nics: Vec::new(),
            cloud_init: None,
            bootrom: None,
        }
    }

    #[test]
    fn start_stop_idempotent_and_persisted() {
        let dir = tempfile::tempdir().unwrap();
        let h = SimHypervisor::open(dir.path(), None).unwrap();
        let s = spec();
        h.start(&s).unwrap();
        h.start(&s).unwrap();
        assert_eq!(h.running(), vec![s.uuid]);
        let mut other = s.clone();
        other.vcpus = 8;
        assert!(matches!(
            h.start(&other),
            Err(HypervisorError::Conflict { .. })
        ));
        let again = SimHypervisor::open(dir.path(), None).unwrap();
        assert_eq!(again.running(), vec![s.uuid]);
        again.stop(s.uuid).unwrap();
        again.stop(s.uuid).unwrap();
        assert!(again.running().is_empty());
        // A shutdown is as prompt, and says whether there was a guest to ask.
        again.start(&s).unwrap();
        let grace = std::time::Duration::from_secs(60);
        assert_eq!(
            again.shutdown(s.uuid, grace).unwrap(),
            Shutdown::GuestShutDown { after_ms: 0 }
        );
        assert_eq!(again.shutdown(s.uuid, grace).unwrap(), Shutdown::NotRunning);
        assert!(again.running().is_empty());
        assert!(
            SimHypervisor::open(dir.path(), None)
                .unwrap()
                .running()
                .is_empty()
        );
    }

    /// A VM placed on a node without its network's bridge fails as on a real node.
    #[test]
    fn a_nic_on_a_missing_bridge_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("sys");
        crate::fake::generate(&root, &crate::fake::FakeSpec::default()).unwrap();
        let h = SimHypervisor::open(dir.path(), Some(&root)).unwrap();
        let nic = |bridge: &str| passage_model::protocol::NicSpec {
            mac: "02:00:00:00:00:01".into(),
            ip: "192.0.2.10".parse().unwrap(),
            prefix_len: 24,
            gateway: None,
            resolvers: Vec::new(),
            bridge: bridge.into(),
            vlan_id: 7,
            mtu: 1500,
            primary: true,
        };
        let mut s = spec();
        s.nics = vec![nic("br7")];
        let e = h.start(&s).unwrap_err().to_string();
        assert!(e.ends_with("bridge br7 does not exist on this node"), "{e}");
        assert!(h.running().is_empty());
        // VLANs are not simulated: br0 has filtering off and still takes a tagged NIC.
        s.nics = vec![nic("br0")];
        h.start(&s).unwrap();
        assert_eq!(h.running(), vec![s.uuid]);
    }

    #[test]
    fn builder_only_backends_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        for kind in [
            super::super::HypervisorKind::CloudHypervisor,
            super::super::HypervisorKind::Bhyve,
        ] {
            let e = super::super::open(kind, dir.path(), None, &Default::default())
                .err()
                .unwrap();
            let text = e.to_string();
            assert!(
                text.contains("not installed here") || text.contains("not supported yet"),
                "{text}"
            );
        }
    }
}
