//! QEMU/KVM: builds the command line, starts `qemu-system-x86_64` as a child, talks to
//! it over QMP and keeps what a restarted agent needs in `STATE/qemu/<vm>/`:
//! `spec.json` (what was asked), `qemu.pid` (QEMU's own `-pidfile`), `qmp.sock`,
//! `qemu.log` (QEMU's stdout and stderr), `console.log` (the guest's serial console,
//! kept with `console.log.0` below a bound: see [`super::console`]), `serial.sock` (the
//! same serial port for an interactive console, one client at a time),
//! `disk.qcow2` (the boot disk, made by the `FetchImage` task: see [`crate::images`]) and
//! `seed.img` (the cloud-init seed, written at each start: see [`crate::seed`]).
//! Each NIC is a persistent tap on its bridge (see [`crate::net`]), made before QEMU starts
//! and removed once it has exited; the spec names them, so a restarted agent knows which
//! taps its adopted VMs hold and removes the others it made.

use super::console;
use super::qmp::Qmp;
use super::{Hypervisor, HypervisorError, check_devices_ready, find_on_path};
use crate::net;
use crate::state::{read_json, write_json};
use passage_model::VmId;
use passage_model::protocol::{Shutdown, VmSpec};
use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

pub mod checks;
mod command;
pub mod layout;
mod pinning;
mod plan;
pub use command::{
    Backing, CpuModel, LaunchPlan, OVMF_VARS_FILE, OVMF_VARS_TMP_FILE, StandIn, qemu_argv,
    vars_path,
};
pub use pinning::{PINNING_FILE, PinPolicy, Pinning, cpu_list};
pub use plan::{HugepagePolicy, launch_plan};

pub const QEMU_BINARY: &str = "qemu-system-x86_64";
/// `sun_path` is 108 bytes on Linux, the terminating NUL included.
const MAX_SOCKET_PATH: usize = 107;
/// The serial port's socket in a VM's directory.
pub const SERIAL_FILE: &str = "serial.sock";
const QMP_TIMEOUT: Duration = Duration::from_secs(5);
/// How long each try of a start waits for QEMU's greeting: QEMU listens on its socket
/// long before it answers (while vfio pins the guest's memory), and a stop meanwhile
/// waits up to this for the start to notice it is cancelled.
const START_QMP_TIMEOUT: Duration = Duration::from_secs(1);
/// Debian's `ovmf` package: the 4 MiB builds (the 2 MiB ones are gone since bookworm).
pub const DEFAULT_OVMF_CODE: &str = "/usr/share/OVMF/OVMF_CODE_4M.fd";
pub const DEFAULT_OVMF_VARS: &str = "/usr/share/OVMF/OVMF_VARS_4M.fd";

/// How long QEMU may take to answer QMP after being spawned: with devices passed
/// through it pins all of the guest's RAM first (vfio), which takes time in proportion
/// to it, so a base plus so much per GiB.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StartLimit {
    pub base_secs: u64,
    pub secs_per_gib: u64,
}

impl StartLimit {
    pub const DEFAULT_BASE_SECS: u64 = 60;
    pub const DEFAULT_SECS_PER_GIB: u64 = 2;
    /// The range a config file may set the base in.
    pub const BASE_SECS: std::ops::RangeInclusive<u64> = 5..=3600;
    /// The range a config file may set the seconds per GiB in.
    pub const SECS_PER_GIB: std::ops::RangeInclusive<u64> = 0..=60;
    /// No start waits longer than this, whatever the VM's size: a day.
    pub const MAX_SECS: u64 = 24 * 3600;

    /// The wait for a VM of `memory_mib`, each started GiB counted whole.
    pub fn for_memory(self, memory_mib: u64) -> Duration {
        let gib = memory_mib.div_ceil(1024);
        let secs = self
            .base_secs
            .saturating_add(gib.saturating_mul(self.secs_per_gib))
            .min(Self::MAX_SECS);
        Duration::from_secs(secs)
    }
}

impl Default for StartLimit {
    fn default() -> Self {
        StartLimit {
            base_secs: Self::DEFAULT_BASE_SECS,
            secs_per_gib: Self::DEFAULT_SECS_PER_GIB,
        }
    }
}
/// How long a VM may take to exit after `quit` before it is killed.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);

/// How to run QEMU on this node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QemuConfig {
    pub binary: PathBuf,
    /// `kvm:tcg` in production (KVM, or emulation where there is none); tests use `tcg`.
    pub accel: String,
    /// The sysfs root the devices are under, for the vfio-pci check before launch.
    pub sysfs_root: Option<PathBuf>,
    /// Give the guest one emulated QEMU `edu` device (1234:11e8) per assigned function
    /// instead of passing the function through: a generated sysfs tree has no real
    /// device behind it, and this lets a guest still see how many it got.
    pub stand_in_devices: bool,
    /// With stand-ins: give each the size of its function's largest BAR
    /// ([`StandIn::SizedBars`]) rather than an `edu` device.
    pub stand_in_bars: bool,
    /// OVMF's code (read-only, shared) and the template of its variables (copied per VM),
    /// for VMs that boot UEFI.
    pub ovmf_code: PathBuf,
    pub ovmf_vars: PathBuf,
    /// How long a start may wait for QEMU.
    pub start: StartLimit,
    /// Whether guest RAM comes from huge pages.
    pub hugepages: HugepagePolicy,
    /// Which VMs' vCPUs get host CPUs of their own.
    pub pin_vcpus: PinPolicy,
    /// The host's own CPUs: no vCPU is pinned there, and QEMU's other threads run there.
    pub host_reserved_cpus: BTreeSet<u32>,
    /// The sysfs of the host QEMU runs on (its NUMA nodes and huge pages), whatever tree
    /// devices come from.
    pub host_sysfs: PathBuf,
}

impl QemuConfig {
    /// How passed functions appear in the guest.
    pub fn stand_in(&self) -> StandIn {
        match (self.stand_in_devices, self.stand_in_bars) {
            (false, _) => StandIn::None,
            (true, false) => StandIn::Edu,
            (true, true) => StandIn::SizedBars,
        }
    }
}

impl QemuConfig {
    /// `qemu-system-x86_64` from PATH with `kvm:tcg`, or `tcg` where `/dev/kvm` is
    /// there but KVM does not work (see [`checks::probe_accel`]); Debian's OVMF.
    pub fn from_path(sysfs_root: Option<&Path>) -> Result<Self, HypervisorError> {
        let binary = find_on_path(QEMU_BINARY).ok_or(HypervisorError::NotInstalled {
            binary: QEMU_BINARY,
        })?;
        Ok(QemuConfig {
            accel: checks::probe_accel(&binary),
            binary,
            sysfs_root: sysfs_root.map(Path::to_path_buf),
            // The fake-sysfs generator's marker: the tree is generated, not a kernel's.
            stand_in_devices: sysfs_root.is_some_and(|r| r.join(crate::host::FAKE_MARKER).exists()),
            stand_in_bars: std::env::var(STAND_IN_ENV).is_ok_and(|v| v.trim() == "sized"),
            ovmf_code: PathBuf::from(DEFAULT_OVMF_CODE),
            ovmf_vars: PathBuf::from(DEFAULT_OVMF_VARS),
            start: StartLimit::default(),
            hugepages: HugepagePolicy::default(),
            pin_vcpus: PinPolicy::default(),
            host_reserved_cpus: BTreeSet::new(),
            host_sysfs: PathBuf::from(net::HOST_SYSFS),
        })
    }

    /// [`Self::from_path`] with the node's settings applied over the defaults.
    pub fn with_options(mut self, opts: &QemuOptions) -> Self {
        if let Some(s) = opts.start {
            self.start = s;
        }
        if let Some(p) = &opts.ovmf_code {
            self.ovmf_code = p.clone();
        }
        if let Some(p) = &opts.ovmf_vars {
            self.ovmf_vars = p.clone();
        }
        if let Some(h) = opts.hugepages {
            self.hugepages = h;
        }
        if let Some(p) = opts.pin_vcpus {
            self.pin_vcpus = p;
        }
        if let Some(r) = &opts.host_reserved_cpus {
            self.host_reserved_cpus = r.iter().copied().collect();
        }
        self
    }
}

/// The node's QEMU settings from its config file; each `None` keeps the default.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct QemuOptions {
    pub start: Option<StartLimit>,
    pub ovmf_code: Option<PathBuf>,
    pub ovmf_vars: Option<PathBuf>,
    pub hugepages: Option<HugepagePolicy>,
    pub pin_vcpus: Option<PinPolicy>,
    pub host_reserved_cpus: Option<Vec<u32>>,
}

/// `sized`: stand-ins over a generated tree are `ivshmem-plain` devices with the real
/// BAR sizes of the functions they stand for ([`StandIn::SizedBars`]), not `edu`.
pub const STAND_IN_ENV: &str = "PASSAGE_QEMU_STAND_IN";

/// Overrides the accelerator (`-machine accel=`): `tcg` on a host whose `/dev/kvm` is
/// there but does not work (a VM without nested virtualisation: QEMU then hangs at
/// start instead of falling back).
pub const ACCEL_ENV: &str = "PASSAGE_QEMU_ACCEL";

/// `kvm:tcg` (KVM, or emulation where there is none) unless the operator names one of
/// QEMU's accelerators; anything else is ignored, as it would only make QEMU refuse to
/// start every VM.
fn accel_from_env(v: Option<String>) -> String {
    match v.as_deref().map(str::trim) {
        Some(a @ ("kvm" | "tcg" | "kvm:tcg" | "tcg:kvm")) => a.to_string(),
        _ => "kvm:tcg".to_string(),
    }
}

/// The files of one VM.
#[derive(Clone, Debug)]
pub struct VmFiles {
    pub dir: PathBuf,
    pub qmp: PathBuf,
    pub pid: PathBuf,
    pub spec: PathBuf,
    pub log: PathBuf,
    pub console: PathBuf,
    /// The serial port's socket (QEMU listens): an interactive console's way in.
    pub serial: PathBuf,
    pub disk: PathBuf,
    pub seed: PathBuf,
}

impl VmFiles {
    pub fn new(state_dir: &Path, vm: VmId) -> Self {
        let dir = state_dir.join("qemu").join(vm.to_string());
        VmFiles {
            qmp: dir.join("qmp.sock"),
            pid: dir.join("qemu.pid"),
            spec: dir.join("spec.json"),
            log: dir.join("qemu.log"),
            console: dir.join("console.log"),
            serial: dir.join(SERIAL_FILE),
            disk: dir.join(crate::images::disk::DISK_FILE),
            seed: dir.join(crate::seed::SEED_FILE),
            dir,
        }
    }
}

/// A VM QEMU runs: the child when this agent started it, else only its pid (a VM
/// adopted after an agent restart, which keeps running across it).
struct Running {
    spec: VmSpec,
    child: Option<Child>,
    pid: u32,
}

/// A VM this backend knows: one whose QEMU is still coming up (pinning its memory can
/// take minutes, and the map must not stay locked meanwhile), or one running.
enum Slot {
    /// Holds the VM's id, so a second start joins this one and a stop cancels it.
    Starting {
        spec: VmSpec,
        cancel: Arc<AtomicBool>,
    },
    Up(Running),
}

impl Slot {
    fn spec(&self) -> &VmSpec {
        match self {
            Slot::Starting { spec, .. } => spec,
            Slot::Up(r) => &r.spec,
        }
    }
}

pub struct QemuHypervisor {
    cfg: QemuConfig,
    state_dir: PathBuf,
    /// Where taps and bridges are: the host's own sysfs, whatever tree devices come from.
    net_root: PathBuf,
    vms: Mutex<BTreeMap<VmId, Slot>>,
    /// Signalled whenever a start ends, for the starts and stops waiting on it.
    started: Condvar,
    /// Held while a start chooses and records its CPUs, so two starts never take the
    /// same ones.
    pinning: Mutex<()>,
}

fn taps_of(spec: &VmSpec) -> impl Iterator<Item = String> + '_ {
    (0..spec.nics.len()).map(|i| net::tap_name(spec.uuid, i))
}

/// Whether `pid` is a live QEMU for `vm`: `/proc/PID/cmdline` names the VM's uuid, so a
/// pid reused by another process after a reboot is not mistaken for the VM.
fn alive(pid: u32, vm: VmId) -> bool {
    let Ok(cmdline) = fs::read(format!("/proc/{pid}/cmdline")) else {
        return false;
    };
    let uuid = vm.to_string();
    cmdline.split(|b| *b == 0).any(|arg| arg == uuid.as_bytes())
}

fn read_pid(path: &Path) -> Option<u32> {
    crate::host::read_attr(path).ok()?.trim().parse().ok()
}

impl QemuHypervisor {
    /// Opens the backend and adopts the VMs a previous agent left running, with their
    /// taps; the other taps an agent made are removed.
    pub fn open(cfg: QemuConfig, state_dir: &Path) -> Result<Self, HypervisorError> {
        let h = QemuHypervisor {
            cfg,
            state_dir: state_dir.to_path_buf(),
            net_root: PathBuf::from(net::HOST_SYSFS),
            vms: Mutex::new(BTreeMap::new()),
            started: Condvar::new(),
            pinning: Mutex::new(()),
        };
        h.adopt()?;
        h.remove_orphan_taps();
        Ok(h)
    }

    /// Taps named as ours whose VM this agent does not run: left by a VM that died, or
    /// by a launch cut short, while no agent was there to remove them.
    fn remove_orphan_taps(&self) {
        let keep: BTreeSet<String> = self
            .lock()
            .values()
            .flat_map(|s| taps_of(s.spec()))
            .collect();
        let taps = match net::our_taps(&self.net_root) {
            Ok(t) => t,
            Err(e) => {
                tracing::warn!(error = %e, "cannot list the network interfaces; leftover taps stay");
                return;
            }
        };
        for tap in taps.iter().filter(|t| !keep.contains(*t)) {
            match net::remove_tap(&self.net_root, tap) {
                Ok(()) => tracing::info!(tap, "removed a tap whose VM is not running"),
                Err(e) => tracing::warn!(tap, error = %e, "could not remove a leftover tap"),
            }
        }
    }

    fn adopt(&self) -> Result<(), HypervisorError> {
        let state_dir = &self.state_dir;
        let root = state_dir.join("qemu");
        let entries = match fs::read_dir(&root) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(source) => return Err(HypervisorError::State { path: root, source }),
        };
        let mut vms = self.lock();
        for entry in entries.flatten() {
            let Some(vm) = entry
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<VmId>().ok())
            else {
                continue;
            };
            let files = VmFiles::new(state_dir, vm);
            let spec: Option<VmSpec> = read_json(&files.spec).ok().flatten();
            match (spec, read_pid(&files.pid)) {
                (Some(spec), Some(pid)) if alive(pid, vm) => {
                    tracing::info!(vm = %vm, pid, "adopted a running QEMU");
                    vms.insert(
                        vm,
                        Slot::Up(Running {
                            spec,
                            child: None,
                            pid,
                        }),
                    );
                }
                // Gone while the agent was away: nothing to keep but the log.
                _ => {
                    let _ = fs::remove_file(&files.qmp);
                    let _ = fs::remove_file(&files.pid);
                    let _ = fs::remove_file(files.dir.join(PINNING_FILE));
                    let _ = crate::state::remove_json(&files.spec);
                }
            }
        }
        Ok(())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<VmId, Slot>> {
        self.vms.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits for a start under way to end (`guard` is the map, released meanwhile).
    fn wait_for_start<'a>(
        &self,
        guard: std::sync::MutexGuard<'a, BTreeMap<VmId, Slot>>,
    ) -> std::sync::MutexGuard<'a, BTreeMap<VmId, Slot>> {
        // Timed, so a missed signal costs a second, not a hang.
        self.started
            .wait_timeout(guard, Duration::from_secs(1))
            .map(|(g, _)| g)
            .unwrap_or_else(|p| p.into_inner().0)
    }

    /// The QMP socket of a running VM, for callers that want to ask QEMU themselves.
    pub fn qmp_socket(&self, vm: VmId) -> PathBuf {
        VmFiles::new(&self.state_dir, vm).qmp
    }

    /// `query-status` of a running VM.
    pub fn status(&self, vm: VmId) -> Result<String, HypervisorError> {
        let sock = self.qmp_socket(vm);
        Qmp::connect(&sock, QMP_TIMEOUT)
            .and_then(|mut q| q.status())
            .map_err(|e| HypervisorError::Qmp {
                vm,
                reason: e.to_string(),
            })
    }

    fn is_live(r: &mut Running, vm: VmId) -> bool {
        match &mut r.child {
            // Reaps an exited child, so it does not linger as a zombie.
            Some(c) => matches!(c.try_wait(), Ok(None)),
            None => alive(r.pid, vm),
        }
    }

    fn launch(&self, spec: &VmSpec, cancel: &AtomicBool) -> Result<Running, HypervisorError> {
        let vm = spec.uuid;
        let files = VmFiles::new(&self.state_dir, vm);
        let state_err = |path: &Path| {
            let path = path.to_path_buf();
            move |source| HypervisorError::State { path, source }
        };
        // The serial port's is the longer name.
        if files.serial.as_os_str().len() > MAX_SOCKET_PATH {
            return Err(HypervisorError::Launch {
                vm,
                reason: format!(
                    "socket path {} is longer than a unix socket allows; use a shorter --state-dir",
                    files.serial.display()
                ),
            });
        }
        fs::create_dir_all(&files.dir).map_err(state_err(&files.dir))?;
        let _ = fs::remove_file(&files.qmp);
        let _ = fs::remove_file(&files.serial);
        let _ = fs::remove_file(&files.pid);
        write_json(&files.spec, spec, 0o600).map_err(state_err(&files.spec))?;
        // The console outlives a stop; a VM started again and again must not grow it.
        console::trim(&files.console).map_err(state_err(&files.console))?;
        // Written at every start, so a seed always says what the spec now says.
        if let Some(ci) = &spec.cloud_init {
            crate::seed::write_seed(&files.seed, vm, ci, &spec.nics).map_err(|e| {
                HypervisorError::Launch {
                    vm,
                    reason: format!("its cloud-init seed: {e}"),
                }
            })?;
        }
        let plan = launch_plan(&self.cfg, spec)
            .map_err(|reason| HypervisorError::Launch { vm, reason })?;
        if plan.bootrom == passage_model::images::Bootrom::Uefi {
            self.ensure_vars(&files)?;
        }
        let pinned = self.choose_cpus(spec, &plan, &files)?;
        let log = fs::File::create(&files.log).map_err(state_err(&files.log))?;
        let log2 = log.try_clone().map_err(state_err(&files.log))?;
        let argv = qemu_argv(&self.cfg, spec, &files, &plan);
        tracing::info!(vm = %vm, command = %argv.join(" "), "starting QEMU");
        let mut child = Command::new(&argv[0])
            .args(&argv[1..])
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2)
            .spawn()
            .map_err(|e| HypervisorError::Launch {
                vm,
                reason: format!("spawning {}: {e}", argv[0]),
            })?;
        let pid = child.id();
        let started = Instant::now();
        let limit = self.cfg.start.for_memory(spec.memory_mib);
        // QEMU opens the QMP socket before the guest runs; once it answers, the VM is up.
        let status = loop {
            if cancel.load(Ordering::Relaxed) {
                let _ = child.kill();
                let _ = child.wait();
                return Err(HypervisorError::Launch {
                    vm,
                    reason: "stopped while starting".to_string(),
                });
            }
            if let Ok(Some(exit)) = child.try_wait() {
                return Err(HypervisorError::Launch {
                    vm,
                    reason: format!("QEMU exited ({exit}): {}", log_tail(&files.log)),
                });
            }
            if files.qmp.exists()
                && let Ok(s) =
                    Qmp::connect(&files.qmp, START_QMP_TIMEOUT).and_then(|mut q| q.status())
            {
                break s;
            }
            if started.elapsed() > limit {
                let _ = child.kill();
                let _ = child.wait();
                return Err(HypervisorError::Launch {
                    vm,
                    reason: format!(
                        "no QMP answer within {}s (the limit for {} MiB of RAM: \
                         qemu_start_base_secs plus qemu_start_secs_per_gib per GiB): {}",
                        limit.as_secs(),
                        spec.memory_mib,
                        log_tail(&files.log)
                    ),
                });
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        if let Some(p) = &pinned
            && let Err(reason) = self.pin(&files, pid, p)
        {
            let _ = child.kill();
            let _ = child.wait();
            let _ = fs::remove_file(files.dir.join(PINNING_FILE));
            return Err(HypervisorError::Launch { vm, reason });
        }
        tracing::info!(vm = %vm, pid, status = %status, "QEMU started");
        Ok(Running {
            spec: spec.clone(),
            child: Some(child),
            pid,
        })
    }

    /// The host CPUs the VM's vCPUs get, chosen and recorded (in its directory) under
    /// the pinning lock; `None` when the policy pins nothing for it.
    fn choose_cpus(
        &self,
        spec: &VmSpec,
        plan: &LaunchPlan,
        files: &VmFiles,
    ) -> Result<Option<Pinning>, HypervisorError> {
        let vm = spec.uuid;
        let pin = match self.cfg.pin_vcpus {
            PinPolicy::Never => false,
            PinPolicy::Always => true,
            PinPolicy::Devices => self.cfg.stand_in() == StandIn::None && !spec.devices.is_empty(),
        };
        let path = files.dir.join(PINNING_FILE);
        if !pin {
            let _ = fs::remove_file(&path);
            return Ok(None);
        }
        let _held_lock = self.pinning.lock().unwrap_or_else(|p| p.into_inner());
        let others: Vec<VmId> = self.lock().keys().copied().filter(|o| *o != vm).collect();
        let held: BTreeSet<u32> = others
            .iter()
            .filter_map(|o| {
                read_json::<Pinning>(&VmFiles::new(&self.state_dir, *o).dir.join(PINNING_FILE))
                    .ok()
                    .flatten()
            })
            .flat_map(|p| p.vcpus)
            .collect();
        let node = {
            let mut n = plan.functions.iter().filter_map(|f| f.numa_node);
            n.next().filter(|first| n.all(|x| x == *first))
        };
        let chosen = pinning::choose(
            &pinning::host_cpus(&self.cfg.host_sysfs),
            &self.cfg.host_reserved_cpus,
            &held,
            &plan.layout,
            spec.vcpus,
            node,
        )
        .map_err(|reason| HypervisorError::Launch { vm, reason })?;
        write_json(&path, &chosen, 0o600)
            .map_err(|source| HypervisorError::State { path, source })?;
        Ok(Some(chosen))
    }

    /// Moves the running QEMU's vCPU threads (from QMP) onto their chosen CPUs.
    fn pin(&self, files: &VmFiles, pid: u32, chosen: &Pinning) -> Result<(), String> {
        let cpus = Qmp::connect(&files.qmp, START_QMP_TIMEOUT)
            .and_then(|mut q| q.execute("query-cpus-fast", None))
            .map_err(|e| format!("QMP query-cpus-fast: {e}"))?;
        let mut threads: Vec<(u64, u64)> = cpus
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|c| {
                        Some((c.get("cpu-index")?.as_u64()?, c.get("thread-id")?.as_u64()?))
                    })
                    .collect()
            })
            .unwrap_or_default();
        threads.sort_unstable();
        let tids: Vec<u64> = threads.into_iter().map(|(_, t)| t).collect();
        pinning::apply(pid, &tids, chosen, &self.cfg.host_reserved_cpus)
            .map_err(|e| format!("pinning its vCPUs: {e}"))
    }

    /// What a start does once the VM's id is reserved: the checks, the taps and QEMU,
    /// with the taps removed again when it fails.
    fn prepare_and_launch(
        &self,
        spec: &VmSpec,
        cancel: &AtomicBool,
    ) -> Result<Running, HypervisorError> {
        let vm = spec.uuid;
        if let Some(root) = &self.cfg.sysfs_root {
            check_devices_ready(root, spec)?;
        }
        checks::before_launch(&self.cfg, spec, checks::agent_memlock_limit())
            .map_err(|reason| HypervisorError::Launch { vm, reason })?;
        let net_err = |source| HypervisorError::Network { vm, source };
        net::check_nics(&self.net_root, &spec.nics, true).map_err(net_err)?;
        let disk = VmFiles::new(&self.state_dir, vm).disk;
        if spec.disk.is_some() && !disk.exists() {
            return Err(HypervisorError::Launch {
                vm,
                reason: format!(
                    "its boot disk {} does not exist (the image was not fetched to this node)",
                    disk.display()
                ),
            });
        }
        let launched = spec
            .nics
            .iter()
            .enumerate()
            .try_for_each(|(i, nic)| {
                net::create_tap(&self.net_root, &net::tap_name(vm, i), nic).map_err(net_err)
            })
            .and_then(|()| self.launch(spec, cancel));
        if launched.is_err() {
            net::remove_vm_taps(&self.net_root, vm);
            // What only a running QEMU needs: a spec left would say a VM is here, and its
            // directory would outlive the VM's disk.
            let files = VmFiles::new(&self.state_dir, vm);
            for f in [&files.qmp, &files.pid, &files.dir.join(PINNING_FILE)] {
                let _ = fs::remove_file(f);
            }
            let _ = crate::state::remove_json(&files.spec);
        }
        launched
    }

    /// The VM's own copy of OVMF's variables, made from the template at its first UEFI
    /// start (through a temporary file, so a copy cut short is never taken for one).
    /// The checks before launch found the template.
    fn ensure_vars(&self, files: &VmFiles) -> Result<(), HypervisorError> {
        let vars = vars_path(files);
        if vars.is_file() {
            return Ok(());
        }
        let tmp = files.dir.join(OVMF_VARS_TMP_FILE);
        fs::copy(&self.cfg.ovmf_vars, &tmp)
            .and_then(|_| fs::rename(&tmp, &vars))
            .map_err(|source| HypervisorError::State { path: vars, source })
    }

    fn shut_down(&self, vm: VmId, mut r: Running) -> Result<(), HypervisorError> {
        let files = VmFiles::new(&self.state_dir, vm);
        if Self::is_live(&mut r, vm)
            && let Err(e) = Qmp::connect(&files.qmp, QMP_TIMEOUT).and_then(|mut q| q.quit())
        {
            tracing::warn!(vm = %vm, error = %e, "QMP quit failed; killing QEMU");
        }
        let deadline = Instant::now() + STOP_TIMEOUT;
        while Self::is_live(&mut r, vm) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        if Self::is_live(&mut r, vm) {
            match &mut r.child {
                Some(c) => {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                // Not our child (adopted): std can only signal children, so ask kill(1).
                None => {
                    let _ = Command::new("kill")
                        .args(["-KILL", &r.pid.to_string()])
                        .status();
                }
            }
        }
        if Self::is_live(&mut r, vm) {
            return Err(HypervisorError::Launch {
                vm,
                reason: format!("QEMU (pid {}) does not exit", r.pid),
            });
        }
        for f in [&files.qmp, &files.pid, &files.dir.join(PINNING_FILE)] {
            let _ = fs::remove_file(f);
        }
        let _ = crate::state::remove_json(&files.spec);
        Ok(())
    }
}

/// The last lines QEMU wrote, for error messages.
fn log_tail(path: &Path) -> String {
    let text = fs::read(path).unwrap_or_default();
    let start = text.len().saturating_sub(600);
    String::from_utf8_lossy(&text[start..]).trim().to_string()
}

impl Hypervisor for QemuHypervisor {
    /// The map is locked only to look and to reserve the VM's id: QEMU's start (minutes
    /// where vfio pins a large guest's memory) runs without it, so heartbeats and the
    /// other VMs' starts and stops go on meanwhile.
    fn start(&self, spec: &VmSpec) -> Result<(), HypervisorError> {
        let vm = spec.uuid;
        let cancel = {
            let mut vms = self.lock();
            let mut joined = false;
            loop {
                match vms.get_mut(&vm) {
                    Some(Slot::Up(r)) => {
                        if Self::is_live(r, vm) {
                            return if &r.spec == spec {
                                Ok(())
                            } else {
                                Err(HypervisorError::Conflict { vm })
                            };
                        }
                        vms.remove(&vm);
                        net::remove_vm_taps(&self.net_root, vm);
                        break;
                    }
                    Some(Slot::Starting { spec: s, .. }) => {
                        if s != spec {
                            return Err(HypervisorError::Conflict { vm });
                        }
                        joined = true;
                        vms = self.wait_for_start(vms);
                    }
                    None if joined => {
                        return Err(HypervisorError::Launch {
                            vm,
                            reason: "the start already under way failed (its task says why)"
                                .to_string(),
                        });
                    }
                    None => break,
                }
            }
            // A clash of names (two uuids alike in their last 44 bits) would take another
            // VM's tap away from it.
            let in_use: BTreeMap<String, VmId> = vms
                .iter()
                .flat_map(|(vm, s)| taps_of(s.spec()).map(|t| (t, *vm)))
                .collect();
            if let Some((tap, other)) = taps_of(spec).find_map(|t| in_use.get(&t).map(|o| (t, *o)))
            {
                return Err(HypervisorError::Network {
                    vm,
                    source: net::NetError::TapInUse { tap, other },
                });
            }
            let cancel = Arc::new(AtomicBool::new(false));
            vms.insert(
                vm,
                Slot::Starting {
                    spec: spec.clone(),
                    cancel: cancel.clone(),
                },
            );
            cancel
        };
        let launched = self.prepare_and_launch(spec, &cancel);
        let mut vms = self.lock();
        vms.remove(&vm);
        let result = match launched {
            Ok(r) => {
                vms.insert(vm, Slot::Up(r));
                Ok(())
            }
            Err(e) => Err(e),
        };
        drop(vms);
        self.started.notify_all();
        result
    }

    /// Also removes the VM's taps, even when it was not running (a VM that died, or
    /// an agent that stopped half way through a launch).
    /// A VM still starting is cancelled (its QEMU killed) first.
    fn stop(&self, vm: VmId) -> Result<(), HypervisorError> {
        let r = {
            let mut vms = self.lock();
            while let Some(Slot::Starting { cancel, .. }) = vms.get(&vm) {
                cancel.store(true, Ordering::Relaxed);
                vms = self.wait_for_start(vms);
            }
            match vms.remove(&vm) {
                Some(Slot::Up(r)) => Some(r),
                Some(other) => {
                    vms.insert(vm, other);
                    None
                }
                None => None,
            }
        };
        if let Some(r) = r {
            // QEMU still holds its taps when it does not exit: they stay with it.
            self.shut_down(vm, r)?;
        }
        net::remove_vm_taps(&self.net_root, vm);
        Ok(())
    }

    /// The VM stays in the map while its guest shuts down, so heartbeats report it
    /// running until it has stopped; a stop meanwhile (a destroy) takes it at once.
    fn shutdown(&self, vm: VmId, grace: Duration) -> Result<Shutdown, HypervisorError> {
        let asked = match self.lock().get_mut(&vm) {
            Some(Slot::Up(r)) => Self::is_live(r, vm).then_some(Ok(())),
            // No guest to ask yet: the start is cancelled.
            Some(Slot::Starting { .. }) => Some(Err("it was still starting".to_string())),
            None => None,
        };
        let asked = asked.map(|a| {
            a.and_then(|()| {
                let files = VmFiles::new(&self.state_dir, vm);
                Qmp::connect(&files.qmp, QMP_TIMEOUT)
                    .and_then(|mut q| q.powerdown())
                    .map_err(|e| format!("QMP: {e}"))
            })
        });
        let outcome = match asked {
            None => Shutdown::NotRunning,
            Some(Err(reason)) => Shutdown::NotAsked { reason },
            Some(Ok(())) => {
                let asked_at = Instant::now();
                let deadline = asked_at + grace;
                loop {
                    let live = match self.lock().get_mut(&vm) {
                        Some(Slot::Up(r)) => Some(Self::is_live(r, vm)),
                        // Stopped meanwhile by another task (a destroy's power cut).
                        _ => None,
                    };
                    match live {
                        None => break Shutdown::NotRunning,
                        Some(false) => {
                            let ms = asked_at.elapsed().as_millis();
                            break Shutdown::GuestShutDown {
                                after_ms: u64::try_from(ms).unwrap_or(u64::MAX),
                            };
                        }
                        Some(true) => {}
                    }
                    if Instant::now() >= deadline {
                        break Shutdown::TimedOut {
                            grace_s: u32::try_from(grace.as_secs()).unwrap_or(u32::MAX),
                        };
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        };
        // Whatever happened: QEMU ended (killed if it must be), taps and state removed.
        self.stop(vm)?;
        Ok(outcome)
    }

    fn stops_slowly(&self) -> bool {
        true
    }

    fn console(&self, vm: VmId) -> Result<String, HypervisorError> {
        let path = VmFiles::new(&self.state_dir, vm).console;
        let state_err = |source| HypervisorError::State {
            path: path.clone(),
            source,
        };
        console::trim(&path).map_err(state_err)?;
        console::tail(&path).map_err(state_err)
    }

    fn starts_slowly(&self) -> bool {
        true
    }

    /// QEMU's socket chardev: a VM started by an agent from before it (a file chardev)
    /// has none until it is stopped and started again.
    fn serial(&self, vm: VmId) -> Result<super::SerialPort, HypervisorError> {
        match self.lock().get(&vm) {
            Some(Slot::Up(_)) => Ok(super::SerialPort::Socket(
                VmFiles::new(&self.state_dir, vm).serial,
            )),
            _ => Err(HypervisorError::NotRunning { vm }),
        }
    }

    fn trim(&self) {
        let vms: Vec<VmId> = self.lock().keys().copied().collect();
        for vm in vms {
            let path = VmFiles::new(&self.state_dir, vm).console;
            if let Err(e) = console::trim(&path) {
                tracing::warn!(%vm, path = %path.display(), error = %e, "trimming a VM's console");
            }
        }
    }

    fn tap_specs(&self) -> Vec<VmSpec> {
        self.lock()
            .values()
            .filter(|s| !s.spec().nics.is_empty())
            .map(|s| s.spec().clone())
            .collect()
    }

    fn running(&self) -> Vec<VmId> {
        let mut vms = self.lock();
        vms.retain(|vm, s| match s {
            // Not running yet; its start owns its taps.
            Slot::Starting { .. } => true,
            Slot::Up(r) => {
                let live = Self::is_live(r, *vm);
                if !live {
                    net::remove_vm_taps(&self.net_root, *vm);
                }
                live
            }
        });
        vms.iter()
            .filter(|(_, s)| matches!(s, Slot::Up(_)))
            .map(|(vm, _)| *vm)
            .collect()
    }
}

#[cfg(test)]
mod start_limit_tests {
    use super::StartLimit;
    use std::time::Duration;

    #[test]
    fn the_wait_grows_with_the_guests_ram() {
        let l = StartLimit::default();
        assert_eq!(l.for_memory(64), Duration::from_secs(62));
        assert_eq!(l.for_memory(80 * 1024), Duration::from_secs(60 + 160));
        // 1.5 GiB counts as 2.
        assert_eq!(l.for_memory(1536), Duration::from_secs(64));
        let huge = StartLimit {
            base_secs: 3600,
            secs_per_gib: 60,
        };
        assert_eq!(
            huge.for_memory(u64::MAX),
            Duration::from_secs(StartLimit::MAX_SECS)
        );
    }
}

#[cfg(test)]
mod accel_tests {
    #[test]
    fn the_accelerator_is_kvm_then_tcg_unless_named() {
        use super::accel_from_env as a;
        assert_eq!(a(None), "kvm:tcg");
        assert_eq!(a(Some("tcg".into())), "tcg");
        assert_eq!(a(Some(" kvm ".into())), "kvm");
        assert_eq!(a(Some("whpx,evil=1".into())), "kvm:tcg");
    }
}
