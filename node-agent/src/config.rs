//! `node-agent run --config FILE`: a TOML file with the same settings as the command
//! line, and the checks that turn a broken host into one clear start-up error.
//!
//! ```toml
//! server = "https://passage.example:8080"
//! join_token_file = "/etc/passage/join-token"
//! sysfs_root = "/sys"
//! state_dir = "/var/lib/passage-agent"
//! hypervisor = "qemu"
//! heartbeat_secs = 10
//! inventory_secs = 60
//! hostname = "cn-7"
//! ca_cert = "/etc/passage/ca.pem"
//! # Scrub tools (see `FileConfig`); each defaults as described there.
//! nvidia_smi = "/usr/bin/nvidia-smi"
//! gpu_zero_helper = "/usr/lib/passage/passage-gpu-zero"
//! dev_dir = "/dev"
//! # Bytes of image files the node keeps (GiB, default 50); see `FileConfig`.
//! image_cache_gib = 50
//! # How long a VM's start may wait for QEMU: base plus so much per GiB of RAM (vfio
//! # pins all of it first); defaults 60 and 2. OVMF for UEFI guests (Debian's `ovmf`).
//! qemu_start_base_secs = 60
//! qemu_start_secs_per_gib = 2
//! ovmf_code = "/usr/share/OVMF/OVMF_CODE_4M.fd"
//! ovmf_vars = "/usr/share/OVMF/OVMF_VARS_4M.fd"
//! # Guest RAM from huge pages: "require", "prefer" (default: 1 GiB pages, else 2 MiB,
//! # else ordinary ones) or "off".
//! hugepages = "prefer"
//! # vCPUs on host CPUs of their own: "devices" (default: VMs given real devices),
//! # "always" or "never"; the host's reserve runs QEMU's other threads and no vCPU.
//! pin_vcpus = "devices"
//! host_reserved_cpus = "0,64"
//! ```

use crate::hypervisor::{HypervisorKind, QemuOptions, StartLimit};
use crate::scrub::ScrubOverrides;
use serde::Deserialize;
use std::fs;
use std::io::{self, Read};
use std::path::{Path, PathBuf};

/// A config file bigger than this is not a config file.
const MAX_CONFIG_LEN: u64 = 64 * 1024;
/// 1 PiB of images: anything larger is a typo.
pub const MAX_IMAGE_CACHE_GIB: u64 = 1024 * 1024;
/// A join token is 64 hex digits; anything much longer is the wrong file.
const MAX_TOKEN_LEN: u64 = 1024;

/// The file's settings; every one optional, the command line wins over each.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub server: Option<String>,
    /// A file holding the join token, so the token stays out of the config and of
    /// `ps` output; only needed until the node has registered.
    pub join_token_file: Option<PathBuf>,
    pub sysfs_root: Option<PathBuf>,
    pub state_dir: Option<PathBuf>,
    #[serde(default, deserialize_with = "hypervisor_kind")]
    pub hypervisor: Option<HypervisorKind>,
    pub heartbeat_secs: Option<u64>,
    /// How often the whole inventory is read again (`--inventory-secs`).
    pub inventory_secs: Option<u64>,
    pub hostname: Option<String>,
    /// The `nvidia-smi` the `nvidia_reset` scrub step runs, and discovery asks for MIG
    /// mode on GPUs that host vGPUs. Default: `nvidia-smi` on the agent's `PATH` (on a
    /// generated tree, the tree's own stand-in for MIG mode); where there is none (or
    /// this file does not exist) the step is reported as skipped and MIG mode unknown.
    pub nvidia_smi: Option<PathBuf>,
    /// The program the `zero_gpu_memory` scrub step runs as `PROGRAM --bdf BDF` (exit 0:
    /// the GPU's memory was zeroed and read back as zero). Default: `passage-gpu-zero` on
    /// the agent's `PATH`; where there is none the step is reported as skipped.
    pub gpu_zero_helper: Option<PathBuf>,
    /// Where the `wipe_nvme_labels` scrub step finds the namespaces' block device nodes
    /// (`DIR/nvme0n1`). Default: `/dev` (on a generated tree, the tree's own stand-ins).
    pub dev_dir: Option<PathBuf>,
    /// A PEM file of CA certificates to trust for an `https://` server, besides the
    /// public roots.
    pub ca_cert: Option<PathBuf>,
    /// The image cache's budget in GiB (`STATE/images`), default 50: beyond it, the
    /// least recently used images no VM on this node is built on are deleted before a new
    /// one is downloaded. Images VMs use are never deleted, even over budget.
    pub image_cache_gib: Option<u64>,
    /// Seconds any VM's start may wait for QEMU to answer, besides
    /// `qemu_start_secs_per_gib` (default 60, 5 to 3600).
    pub qemu_start_base_secs: Option<u64>,
    /// Seconds more per GiB of the VM's RAM, which vfio pins before QEMU answers
    /// (default 2, 0 to 60).
    pub qemu_start_secs_per_gib: Option<u64>,
    /// OVMF's code for UEFI guests (default `/usr/share/OVMF/OVMF_CODE_4M.fd`).
    pub ovmf_code: Option<PathBuf>,
    /// OVMF's variable-store template (default `/usr/share/OVMF/OVMF_VARS_4M.fd`).
    pub ovmf_vars: Option<PathBuf>,
    /// Whether guest RAM comes from huge pages (default `prefer`).
    pub hugepages: Option<crate::hypervisor::HugepagePolicy>,
    /// Which VMs' vCPUs are pinned (default `devices`).
    pub pin_vcpus: Option<crate::hypervisor::PinPolicy>,
    /// A kernel CPU list the host keeps for itself and QEMU's own threads.
    pub host_reserved_cpus: Option<String>,
}

fn hypervisor_kind<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<HypervisorKind>, D::Error> {
    let s = String::deserialize(d)?;
    <HypervisorKind as clap::ValueEnum>::from_str(&s, false)
        .map(Some)
        .map_err(|_| {
            serde::de::Error::custom(format!(
                "hypervisor {s:?} is not one of sim, qemu, cloud-hypervisor, bhyve"
            ))
        })
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("config file {path}: {source}")]
    Read { path: PathBuf, source: io::Error },
    #[error("config file {path} is larger than {MAX_CONFIG_LEN} bytes")]
    TooLarge { path: PathBuf },
    #[error("config file {path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("config file {path}: heartbeat_secs must be between 1 and 3600, not {value}")]
    Heartbeat { path: PathBuf, value: u64 },
    #[error("config file {path}: inventory_secs must be between 1 and 3600, not {value}")]
    Inventory { path: PathBuf, value: u64 },
    #[error("config file {path}: {key} must be an absolute path, not {value:?}")]
    RelativePath {
        path: PathBuf,
        key: &'static str,
        value: PathBuf,
    },
    #[error("config file {path}: image_cache_gib must be between 1 and 1048576, not {value}")]
    ImageCache { path: PathBuf, value: u64 },
    #[error("config file {path}: {key} must be between {min} and {max}, not {value}")]
    OutOfRange {
        path: PathBuf,
        key: &'static str,
        min: u64,
        max: u64,
        value: u64,
    },
    #[error("join token file {path}: {reason}")]
    Token { path: PathBuf, reason: String },
}

fn read_bounded(path: &Path, max: u64) -> io::Result<Option<String>> {
    let mut s = String::new();
    let n = fs::File::open(path)?.take(max + 1).read_to_string(&mut s)?;
    Ok((n as u64 <= max).then_some(s))
}

impl FileConfig {
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = read_bounded(path, MAX_CONFIG_LEN)
            .map_err(|source| ConfigError::Read {
                path: path.to_path_buf(),
                source,
            })?
            .ok_or_else(|| ConfigError::TooLarge {
                path: path.to_path_buf(),
            })?;
        Self::parse(path, &text)
    }

    pub fn parse(path: &Path, text: &str) -> Result<Self, ConfigError> {
        let cfg: FileConfig = toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: path.to_path_buf(),
            message: e.message().to_string(),
        })?;
        if let Some(v) = cfg.heartbeat_secs
            && !(1..=3600).contains(&v)
        {
            return Err(ConfigError::Heartbeat {
                path: path.to_path_buf(),
                value: v,
            });
        }
        if let Some(v) = cfg.inventory_secs
            && !(1..=3600).contains(&v)
        {
            return Err(ConfigError::Inventory {
                path: path.to_path_buf(),
                value: v,
            });
        }
        if let Some(v) = cfg.image_cache_gib
            && !(1..=MAX_IMAGE_CACHE_GIB).contains(&v)
        {
            return Err(ConfigError::ImageCache {
                path: path.to_path_buf(),
                value: v,
            });
        }
        for (key, value, range) in [
            (
                "qemu_start_base_secs",
                cfg.qemu_start_base_secs,
                StartLimit::BASE_SECS,
            ),
            (
                "qemu_start_secs_per_gib",
                cfg.qemu_start_secs_per_gib,
                StartLimit::SECS_PER_GIB,
            ),
        ] {
            if let Some(v) = value
                && !range.contains(&v)
            {
                return Err(ConfigError::OutOfRange {
                    path: path.to_path_buf(),
                    key,
                    min: *range.start(),
                    max: *range.end(),
                    value: v,
                });
            }
        }
        if let Some(list) = &cfg.host_reserved_cpus
            && passage_model::protocol::parse_cpu_list(list).is_none()
        {
            return Err(ConfigError::OutOfRange {
                path: path.to_path_buf(),
                key: "host_reserved_cpus (a CPU list such as \"0,64\")",
                min: 0,
                max: u64::from(passage_model::protocol::MAX_HOST_CPUS - 1),
                value: 0,
            });
        }
        for (key, value) in [
            ("nvidia_smi", &cfg.nvidia_smi),
            ("gpu_zero_helper", &cfg.gpu_zero_helper),
            ("dev_dir", &cfg.dev_dir),
            ("ovmf_code", &cfg.ovmf_code),
            ("ovmf_vars", &cfg.ovmf_vars),
        ] {
            // Relative to whatever directory the service manager started the agent in
            // would be a different program on another node.
            if let Some(v) = value
                && !v.is_absolute()
            {
                return Err(ConfigError::RelativePath {
                    path: path.to_path_buf(),
                    key,
                    value: v.clone(),
                });
            }
        }
        Ok(cfg)
    }

    /// The QEMU settings, for [`crate::hypervisor::QemuConfig::with_options`].
    pub fn qemu_options(&self) -> QemuOptions {
        let start = (self.qemu_start_base_secs.is_some() || self.qemu_start_secs_per_gib.is_some())
            .then(|| StartLimit {
                base_secs: self
                    .qemu_start_base_secs
                    .unwrap_or(StartLimit::DEFAULT_BASE_SECS),
                secs_per_gib: self
                    .qemu_start_secs_per_gib
                    .unwrap_or(StartLimit::DEFAULT_SECS_PER_GIB),
            });
        QemuOptions {
            start,
            hugepages: self.hugepages,
            pin_vcpus: self.pin_vcpus,
            host_reserved_cpus: self
                .host_reserved_cpus
                .as_deref()
                .and_then(passage_model::protocol::parse_cpu_list),
            ovmf_code: self.ovmf_code.clone(),
            ovmf_vars: self.ovmf_vars.clone(),
        }
    }

    /// The scrub settings, for [`crate::scrub::ScrubEnv::with_overrides`].
    pub fn scrub_overrides(&self) -> ScrubOverrides {
        ScrubOverrides {
            nvidia_smi: self.nvidia_smi.clone(),
            gpu_zero_helper: self.gpu_zero_helper.clone(),
            dev_dir: self.dev_dir.clone(),
        }
    }
}

/// Reads a join token file: one line, surrounding whitespace ignored.
pub fn read_token_file(path: &Path) -> Result<String, ConfigError> {
    let err = |reason: String| ConfigError::Token {
        path: path.to_path_buf(),
        reason,
    };
    let text = read_bounded(path, MAX_TOKEN_LEN)
        .map_err(|e| err(e.to_string()))?
        .ok_or_else(|| err(format!("larger than {MAX_TOKEN_LEN} bytes")))?;
    let token = text.trim();
    if token.is_empty() || token.contains(char::is_whitespace) {
        return Err(err("must hold one token on one line".to_string()));
    }
    Ok(token.to_string())
}

/// What is wrong with a host before the agent starts, in words an operator can act on.
#[derive(Debug, thiserror::Error)]
pub enum PreflightError {
    #[error("sysfs root {0} does not exist (is sysfs mounted? use --sysfs-root for a test tree)")]
    NoSysfs(PathBuf),
    #[error(
        "{0} is missing: this kernel shows no PCI bus (not Linux, or a container without /sys/bus/pci)"
    )]
    NoPciBus(PathBuf),
    #[error(
        "state dir {path} is not writable ({source}); run the agent as root or choose another --state-dir"
    )]
    StateDir { path: PathBuf, source: io::Error },
}

/// Checks the sysfs root and the state dir: the two things a misconfigured host gets
/// wrong, found before registering rather than as a confusing failure later.
pub fn preflight(sysfs_root: &Path, state_dir: &Path) -> Result<(), PreflightError> {
    if !sysfs_root.is_dir() {
        return Err(PreflightError::NoSysfs(sysfs_root.to_path_buf()));
    }
    let devices = sysfs_root.join("bus/pci/devices");
    if !devices.is_dir() {
        return Err(PreflightError::NoPciBus(devices));
    }
    let state_err = |source| PreflightError::StateDir {
        path: state_dir.to_path_buf(),
        source,
    };
    fs::create_dir_all(state_dir).map_err(state_err)?;
    // Creating a file is the only sure test: mode bits lie under root, ACLs and
    // read-only mounts.
    let probe = state_dir.join(format!(".write-test-{}", std::process::id()));
    fs::write(&probe, b"").map_err(state_err)?;
    let _ = fs::remove_file(&probe);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_full_file() {
        let text = r#"
            server = "http://127.0.0.1:8080"
            join_token_file = "/etc/passage/join-token"
            sysfs_root = "/sys"
            state_dir = "/var/lib/passage-agent"
            hypervisor = "cloud-hypervisor"
            heartbeat_secs = 5
            inventory_secs = 30
            hostname = "cn-1"
            nvidia_smi = "/usr/bin/nvidia-smi"
            gpu_zero_helper = "/opt/passage/passage-gpu-zero"
            dev_dir = "/dev"
            image_cache_gib = 20
        "#;
        let c = FileConfig::parse(Path::new("a.toml"), text).unwrap();
        assert_eq!(c.server.as_deref(), Some("http://127.0.0.1:8080"));
        assert_eq!(c.hypervisor, Some(HypervisorKind::CloudHypervisor));
        assert_eq!(c.heartbeat_secs, Some(5));
        assert_eq!(c.inventory_secs, Some(30));
        assert_eq!(c.image_cache_gib, Some(20));
        let o = c.scrub_overrides();
        assert_eq!(o.nvidia_smi, Some(PathBuf::from("/usr/bin/nvidia-smi")));
        assert_eq!(
            o.gpu_zero_helper,
            Some(PathBuf::from("/opt/passage/passage-gpu-zero"))
        );
        assert_eq!(o.dev_dir, Some(PathBuf::from("/dev")));
        assert_eq!(
            FileConfig::parse(Path::new("a.toml"), "").unwrap(),
            FileConfig::default()
        );
    }

    #[test]
    fn qemu_settings() {
        let c = FileConfig::parse(
            Path::new("a.toml"),
            "qemu_start_base_secs = 120\novmf_vars = \"/opt/ovmf/VARS.fd\"\n",
        )
        .unwrap();
        let o = c.qemu_options();
        // The per-GiB part keeps its default when only the base is set.
        assert_eq!(
            o.start,
            Some(StartLimit {
                base_secs: 120,
                secs_per_gib: StartLimit::DEFAULT_SECS_PER_GIB
            })
        );
        assert_eq!(o.ovmf_vars, Some(PathBuf::from("/opt/ovmf/VARS.fd")));
        assert_eq!(o.ovmf_code, None);
        assert_eq!(FileConfig::default().qemu_options(), QemuOptions::default());
        let e = FileConfig::parse(Path::new("a.toml"), "qemu_start_secs_per_gib = 100")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("qemu_start_secs_per_gib must be between 0 and 60, not 100"),
            "{e}"
        );
    }

    #[test]
    fn refuses_bad_files() {
        for bad in [
            "server = 1",
            "colour = \"green\"",
            "hypervisor = \"vmware\"",
            "heartbeat_secs = 0",
            "heartbeat_secs = -1",
            "heartbeat_secs = 99999",
            "inventory_secs = 0",
            "inventory_secs = 99999",
            "[[[",
            "server = \"a\"\nserver = \"b\"",
            "nvidia_smi = \"bin/nvidia-smi\"",
            "dev_dir = \"dev\"",
            "gpu_zero_helper = 3",
            "image_cache_gib = 0",
            "image_cache_gib = -5",
            "qemu_start_base_secs = 0",
            "qemu_start_base_secs = 3601",
            "qemu_start_secs_per_gib = 61",
            "ovmf_code = \"OVMF_CODE.fd\"",
        ] {
            let e = FileConfig::parse(Path::new("x.toml"), bad);
            assert!(e.is_err(), "{bad:?} accepted");
            assert!(e.unwrap_err().to_string().contains("x.toml"));
        }
        let dir = tempfile::tempdir().unwrap();
        let big = dir.path().join("big.toml");
        fs::write(&big, "#".repeat(MAX_CONFIG_LEN as usize + 1)).unwrap();
        assert!(matches!(
            FileConfig::load(&big),
            Err(ConfigError::TooLarge { .. })
        ));
        assert!(matches!(
            FileConfig::load(&dir.path().join("missing.toml")),
            Err(ConfigError::Read { .. })
        ));
    }

    #[test]
    fn token_files() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t");
        fs::write(&p, "abc123\n").unwrap();
        assert_eq!(read_token_file(&p).unwrap(), "abc123");
        for bad in ["", "\n", "a b", &"a".repeat(2000)] {
            fs::write(&p, bad).unwrap();
            assert!(read_token_file(&p).is_err(), "{bad:?}");
        }
        assert!(read_token_file(&dir.path().join("none")).is_err());
    }

    #[test]
    fn preflight_names_the_problem() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        let e = preflight(&dir.path().join("nosys"), &state).unwrap_err();
        assert!(matches!(e, PreflightError::NoSysfs(_)), "{e}");
        let e = preflight(dir.path(), &state).unwrap_err();
        assert!(matches!(e, PreflightError::NoPciBus(_)), "{e}");
        let sys = dir.path().join("sys");
        fs::create_dir_all(sys.join("bus/pci/devices")).unwrap();
        preflight(&sys, &state).unwrap();
        // A state dir under a regular file cannot be created, whoever runs the test
        // (root ignores mode bits, so a read-only dir would not do).
        let file = dir.path().join("file");
        fs::write(&file, "").unwrap();
        let e = preflight(&sys, &file.join("state")).unwrap_err();
        assert!(matches!(e, PreflightError::StateDir { .. }), "{e}");
        assert!(e.to_string().contains("not writable"));
    }
}
