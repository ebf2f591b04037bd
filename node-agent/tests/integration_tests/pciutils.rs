#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The fake tree must look like a kernel's to pciutils, and `node-agent lspci` must agree
//! with pciutils' `lspci` both on a fake tree and on the machine's own /sys.

use node_agent::fake::{FakeSpec, GpuModel, generate};
use node_agent::host::{PCI_IDS_VERSION, discover};
use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

const LSPCI: &str = "/usr/bin/lspci";

fn lspci_bin() -> &'static str {
    assert!(
        Path::new(LSPCI).exists(),
        "install pciutils (cargo xtask test does)"
    );
    LSPCI
}

/// BDF → (vendor, device, class base+sub, revision) from `lspci -n -D` lines such as
/// `0000:05:00.0 0302: 10de:2330 (rev a1)`.
fn parse_lspci(out: &str) -> BTreeMap<String, (String, String, String, String)> {
    let mut m = BTreeMap::new();
    for line in out.lines().filter(|l| !l.trim().is_empty()) {
        let mut it = line.split_whitespace();
        let bdf = it.next().unwrap().to_string();
        let class = it.next().unwrap().trim_end_matches(':').to_string();
        let (v, d) = it.next().unwrap().split_once(':').unwrap();
        let rest: Vec<&str> = it.collect();
        let rev = rest
            .windows(2)
            .find(|w| w[0] == "(rev")
            .map(|w| w[1].trim_end_matches(')').to_string())
            .unwrap_or_else(|| "00".to_string());
        m.insert(bdf, (v.to_string(), d.to_string(), class, rev));
    }
    m
}

/// `node-agent lspci` lines (`vendor device subsystem subvendor revision id driver`),
/// keyed by the BDF at the end of the id.
fn parse_agent(out: &str) -> BTreeMap<String, Vec<String>> {
    out.lines()
        .map(|l| {
            let f: Vec<String> = l.split_whitespace().map(str::to_string).collect();
            assert_eq!(f.len(), 7, "bad lister line {l:?}");
            let bdf = f[5].rsplit('/').next().unwrap().to_string();
            (bdf, f)
        })
        .collect()
}

fn agent_lspci(root: &Path) -> (String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_node-agent"))
        .arg("lspci")
        .arg("--sysfs-root")
        .arg(root)
        .output()
        .unwrap();
    assert!(out.status.success(), "node-agent lspci failed: {out:?}");
    (
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

/// BDF → the `Region N: …` lines of pciutils' `lspci -vv -D` (blocks that start with the
/// BDF, indented lines below), tabs and spaces around them trimmed.
fn parse_lspci_regions(out: &str) -> BTreeMap<String, Vec<String>> {
    let mut m: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut bdf = None;
    for line in out.lines() {
        if !line.starts_with(char::is_whitespace) && !line.is_empty() {
            let b = line.split_whitespace().next().unwrap().to_string();
            m.entry(b.clone()).or_default();
            bdf = Some(b);
        } else if let (Some(b), Some(r)) = (&bdf, line.trim().strip_prefix("Region ")) {
            m.get_mut(b).unwrap().push(format!("Region {r}"));
        }
    }
    m
}

/// The same from `node-agent lspci -v`, whose blocks start with the lister line.
fn parse_agent_regions(out: &str) -> BTreeMap<String, Vec<String>> {
    let mut m: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut bdf = None;
    for line in out.lines() {
        if !line.starts_with(char::is_whitespace) && !line.is_empty() {
            let id = line.split_whitespace().nth(5).unwrap();
            let b = id.rsplit('/').next().unwrap().to_string();
            m.entry(b.clone()).or_default();
            bdf = Some(b);
        } else if let (Some(b), Some(r)) = (&bdf, line.trim().strip_prefix("Region ")) {
            m.get_mut(b).unwrap().push(format!("Region {r}"));
        }
    }
    m
}

fn agent_lspci_verbose(root: Option<&Path>) -> String {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_node-agent"));
    cmd.args(["lspci", "-v"]);
    if let Some(root) = root {
        cmd.arg("--sysfs-root").arg(root);
    }
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "node-agent lspci -v failed: {out:?}");
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn regions_agree_with_pciutils_on_every_generated_model() {
    let lspci = lspci_bin();
    let dir = tempfile::tempdir().unwrap();
    for (i, model) in [
        GpuModel::H100,
        GpuModel::A100,
        GpuModel::L40s,
        GpuModel::V100,
    ]
    .into_iter()
    .enumerate()
    {
        let root = dir.path().join(format!("sys{i}"));
        let spec = FakeSpec {
            gpus: 4,
            model,
            numa_nodes: 2,
        };
        let opts = node_agent::fake::FakeOptions {
            gpu_audio: model == GpuModel::L40s,
            ..node_agent::fake::FakeOptions::default()
        };
        let tree = node_agent::fake::generate_with(&root, &spec, &opts).unwrap();
        let sysfs_path = format!("sysfs.path={}", root.join("bus/pci").display());
        let out = Command::new(lspci)
            .args(["-A", "linux-sysfs", "-O", &sysfs_path, "-vv", "-D"])
            .output()
            .unwrap();
        assert!(out.status.success(), "lspci failed: {out:?}");
        let theirs = parse_lspci_regions(&String::from_utf8(out.stdout).unwrap());
        let ours = parse_agent_regions(&agent_lspci_verbose(Some(&root)));
        assert_eq!(ours.len(), tree.functions.len());
        assert_eq!(ours, theirs, "{model:?}");

        // The GPUs' layout, as the datasheets give it.
        let framebuffer = match model {
            GpuModel::V100 => "32G",
            GpuModel::L40s => "64G",
            _ => "128G",
        };
        for g in &tree.gpus {
            let r = &ours[&g.address().to_string()];
            assert_eq!(r.len(), 3, "{g}: {r:?}");
            assert!(
                r[0].starts_with("Region 0: Memory at ")
                    && r[0].ends_with("(32-bit, non-prefetchable) [size=16M]")
            );
            assert!(
                r[1].ends_with(&format!("(64-bit, prefetchable) [size={framebuffer}]")),
                "{r:?}"
            );
            assert!(
                r[2].starts_with("Region 3: ")
                    && r[2].ends_with("(64-bit, prefetchable) [size=32M]")
            );
        }
        // I/O ports and 64-bit non-prefetchable registers appear too (NIC, NVMe, SMBus).
        let all: Vec<&String> = ours.values().flatten().collect();
        assert!(all.iter().any(|l| l.contains("I/O ports at ")));
        assert!(all.iter().any(|l| l.contains("(64-bit, non-prefetchable)")));
    }
}

#[test]
fn regions_agree_with_pciutils_on_this_machine() {
    let lspci = lspci_bin();
    let empty = std::fs::read_dir("/sys/bus/pci/devices")
        .map(|mut d| d.next().is_none())
        .unwrap_or(true);
    if empty {
        eprintln!("note: /sys/bus/pci/devices is empty here; nothing to compare");
        return;
    }
    let out = Command::new(lspci).args(["-vv", "-D"]).output().unwrap();
    assert!(out.status.success(), "lspci failed: {out:?}");
    let theirs = parse_lspci_regions(&String::from_utf8(out.stdout).unwrap());
    let ours = parse_agent_regions(&agent_lspci_verbose(None));
    let mut compared = 0;
    for (bdf, regions) in &ours {
        let Some(t) = theirs.get(bdf) else { continue };
        // Config space says what `resource` cannot: a region the function has turned
        // off, or one only the kernel knows of. Those lines are not compared.
        if t.iter()
            .any(|l| l.ends_with("[disabled]") || l.contains("[virtual]"))
        {
            eprintln!("note: {bdf} has disabled or virtual regions: {t:?}");
            continue;
        }
        assert_eq!(regions, t, "regions of {bdf}");
        compared += regions.len();
    }
    eprintln!("compared {compared} regions of {} functions", ours.len());
}

#[test]
fn pciutils_reads_the_fake_tree_like_node_agent() {
    let lspci = lspci_bin();
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("sys");
    let spec = FakeSpec {
        gpus: 8,
        model: GpuModel::H100,
        numa_nodes: 2,
    };
    let tree = generate(&root, &spec).unwrap();
    assert_eq!(tree.gpus.len(), 8);

    let sysfs_path = format!("sysfs.path={}", root.join("bus/pci").display());
    let out = Command::new(lspci)
        .args(["-A", "linux-sysfs", "-O", &sysfs_path, "-n", "-D"])
        .output()
        .unwrap();
    assert!(out.status.success(), "lspci failed: {out:?}");
    let theirs = parse_lspci(&String::from_utf8(out.stdout).unwrap());

    let (stdout, stderr) = agent_lspci(&root);
    assert!(stderr.trim().is_empty(), "skipped functions: {stderr}");
    let ours = parse_agent(&stdout);
    assert_eq!(ours.len(), tree.functions.len());

    let ours_cmp: BTreeMap<String, (String, String, String, String)> = ours
        .iter()
        .map(|(bdf, f)| {
            let root_rel = f[5].trim_start_matches('/');
            let class = std::fs::read_to_string(root.join(root_rel).join("class")).unwrap();
            let class = class.trim().trim_start_matches("0x")[..4].to_string();
            (
                bdf.clone(),
                (f[0].clone(), f[1].clone(), class, f[4].clone()),
            )
        })
        .collect();
    assert_eq!(theirs, ours_cmp);

    let gpus = ours.values().filter(|f| f[1] == "2330").count();
    assert_eq!(gpus, 8);
    assert!(
        ours.values()
            .filter(|f| f[1] == "2330")
            .all(|f| f[6] == "nvidia")
    );

    // The machine-readable form also carries subsystem ids and the programming interface.
    let out = Command::new(lspci)
        .args(["-A", "linux-sysfs", "-O", &sysfs_path, "-mm", "-n", "-D"])
        .output()
        .unwrap();
    assert!(out.status.success());
    for line in String::from_utf8(out.stdout).unwrap().lines() {
        let parts: Vec<&str> = line.split_whitespace().collect();
        let bdf = parts[0];
        let quoted: Vec<&str> = parts
            .iter()
            .filter(|p| p.starts_with('"'))
            .map(|p| p.trim_matches('"'))
            .collect();
        let f = &ours[bdf];
        // Bridges have type-1 headers, where pciutils finds no subsystem ids.
        if quoted.len() == 5 && !quoted[3].is_empty() {
            assert_eq!(
                (quoted[3], quoted[4]),
                (f[3].as_str(), f[2].as_str()),
                "{line}"
            );
        }
    }

    // Topology: every GPU sits behind a switch, and the GPUs span both NUMA roots.
    for g in &tree.gpus {
        assert_eq!(g.parents().len(), 3, "{g}");
    }
    let roots: std::collections::BTreeSet<String> = tree
        .gpus
        .iter()
        .map(|g| g.to_string().split('/').nth(2).unwrap().to_string())
        .collect();
    assert_eq!(roots.len(), 2);
}

#[test]
fn node_agent_agrees_with_lspci_on_this_machine() {
    let lspci = lspci_bin();
    let empty = std::fs::read_dir("/sys/bus/pci/devices")
        .map(|mut d| d.next().is_none())
        .unwrap_or(true);
    if empty {
        eprintln!("note: /sys/bus/pci/devices is empty here; nothing to compare");
        return;
    }
    let out = Command::new(lspci).args(["-n", "-D"]).output().unwrap();
    assert!(out.status.success(), "lspci failed: {out:?}");
    let theirs = parse_lspci(&String::from_utf8(out.stdout).unwrap());

    let out = Command::new(env!("CARGO_BIN_EXE_node-agent"))
        .arg("lspci")
        .output()
        .unwrap();
    let stdout = String::from_utf8(out.stdout).unwrap();
    let stderr = String::from_utf8(out.stderr).unwrap();
    let ours = parse_agent(&stdout);
    // Functions whose sysfs path is not a plain PCI chain (VMD domains, Hyper-V) are
    // skipped with a reason; they still count as seen.
    let skipped: Vec<String> = stderr
        .lines()
        .filter_map(|l| l.strip_prefix("skipped "))
        .filter_map(|l| {
            l.split_whitespace()
                .next()
                .and_then(|p| p.trim_end_matches(':').rsplit('/').next())
                .map(str::to_string)
        })
        .collect();
    if !skipped.is_empty() {
        eprintln!("note: node-agent skipped {skipped:?}:\n{stderr}");
    }
    for (bdf, (v, d, _, rev)) in &theirs {
        match ours.get(bdf) {
            Some(f) => {
                assert_eq!((&f[0], &f[1], &f[4]), (v, d, rev), "ids differ for {bdf}");
            }
            None => assert!(
                skipped.iter().any(|s| s == bdf),
                "{bdf} neither listed nor skipped; stderr: {stderr}"
            ),
        }
    }
    for bdf in ours.keys() {
        assert!(theirs.contains_key(bdf), "{bdf} listed by node-agent only");
    }

    // Class (base and subclass) and revision, from the library's own discovery.
    let found = discover(Path::new("/sys"));
    for d in &found.devices {
        let bdf = d.address().to_string();
        let (_, _, class, rev) = &theirs[&bdf];
        assert_eq!(&d.class.to_string()[..4], class.as_str(), "class of {bdf}");
        assert_eq!(&d.revision.to_string(), rev, "revision of {bdf}");
    }
}

/// `lspci -D -mm` lines: BDF → (vendor name, device name). pciutils writes `Vendor XXXX`
/// or `Device XXXX` for ids its database lacks; those come back as `None`.
fn parse_lspci_names(out: &str) -> BTreeMap<String, (Option<String>, Option<String>)> {
    let mut m = BTreeMap::new();
    for line in out.lines() {
        let Some((bdf, rest)) = line.split_once(' ') else {
            continue;
        };
        let quoted: Vec<&str> = rest.split('"').skip(1).step_by(2).collect();
        if quoted.len() < 3 {
            continue;
        }
        let known = |s: &str, unknown_prefix: &str| {
            let hex_only = s.len() == 4 && s.bytes().all(|b| b.is_ascii_hexdigit());
            (!s.starts_with(unknown_prefix) && !hex_only && !s.is_empty()).then(|| s.to_string())
        };
        m.insert(
            bdf.to_string(),
            (known(quoted[1], "Vendor "), known(quoted[2], "Device ")),
        );
    }
    m
}

/// The `Version:` line of the pci.ids pciutils reads, if it can be found.
fn system_pci_ids_version() -> Option<String> {
    ["/usr/share/misc/pci.ids", "/usr/share/hwdata/pci.ids"]
        .iter()
        .filter_map(|p| std::fs::read_to_string(p).ok())
        .find_map(|text| {
            text.lines()
                .take(20)
                .find_map(|l| {
                    l.trim_start_matches(['#', ' ', '\t'])
                        .strip_prefix("Version:")
                })
                .map(|v| v.trim().to_string())
        })
}

#[test]
fn names_agree_with_lspci_on_this_machine() {
    let lspci = lspci_bin();
    let found = discover(Path::new("/sys"));
    if found.devices.is_empty() {
        eprintln!("note: no PCI functions in /sys here; nothing to compare");
        return;
    }
    let out = Command::new(lspci).args(["-D", "-mm"]).output().unwrap();
    assert!(out.status.success(), "lspci failed: {out:?}");
    let theirs = parse_lspci_names(&String::from_utf8(out.stdout).unwrap());
    let same_db = system_pci_ids_version().as_deref() == Some(PCI_IDS_VERSION);
    let (mut vendors, mut devices, mut renamed) = (0, 0, Vec::new());
    for d in &found.devices {
        let bdf = d.address().to_string();
        let Some((their_vendor, their_device)) = theirs.get(&bdf) else {
            continue;
        };
        let details = d.details.as_ref().unwrap();
        if let (Some(t), Some(o)) = (their_vendor, &details.vendor_name) {
            // Vendor names are stable across database versions: always exact.
            assert_eq!(o, t, "vendor name of {bdf} ({})", d.vendor);
            vendors += 1;
        }
        if let (Some(t), Some(o)) = (their_device, &details.device_name) {
            if o == t {
                devices += 1;
            } else {
                renamed.push(format!(
                    "{bdf} {}:{}: ours {o:?}, lspci {t:?}",
                    d.vendor, d.device
                ));
            }
        }
    }
    eprintln!(
        "compared {vendors} vendor and {} device names (ours: pci.ids {PCI_IDS_VERSION}, \
         system: {:?})",
        devices + renamed.len(),
        system_pci_ids_version()
    );
    if same_db {
        assert!(renamed.is_empty(), "device names differ: {renamed:#?}");
    } else if !renamed.is_empty() {
        eprintln!(
            "note: device names renamed between the two pci.ids versions (not a failure):\n{}",
            renamed.join("\n")
        );
    }
}
