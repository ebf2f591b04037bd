//! The metadata service on its own, with real traffic and no VM: inside a network
//! namespace, a bridge with two veth pairs standing in for two VMs' taps, each far end in
//! a namespace of its own as the guest. The guests route through a gateway elsewhere on
//! the bridge (a static neighbour) and the host has no address in their subnet, as on a
//! node whose VMs use an outside router. Checked:
//!
//! - each guest's `curl 169.254.169.254/latest/meta-data/instance-id` answers its own VM;
//! - a large answer arrives whole through the port rewrites (the TCP checksums hold);
//! - a guest cannot reach the other VM's port, nor the address at another port;
//! - a VM gone loses its answers and its chains; a restarted service answers again.
//!
//! Needs root, iproute2, nftables and curl; skips with a note where they are missing,
//! except in CI.

use super::netns::{self, NetNs};
use node_agent::metadata::MetadataService;
use node_agent::net::{HOST_SYSFS, master_of, our_taps, tap_name};
use passage_model::VmId;
use passage_model::protocol::{CloudInitSpec, NicSpec, VmSpec};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

const BRIDGE: &str = "pstbrm";
const VM1: &str = "0190f3c4-7a2b-7c3d-8e4f-00000000a001";
const VM2: &str = "0190f3c4-7a2b-7c3d-8e4f-00000000a002";
const GUEST_ENV: &str = "PASSAGE_TEST_META_GUESTS";

fn vm(n: usize) -> VmId {
    [VM1, VM2][n].parse().unwrap()
}

fn mac(n: usize) -> String {
    format!("02:00:00:00:a0:0{}", n + 1)
}

fn spec(n: usize, user_data: Option<String>) -> VmSpec {
    VmSpec {
        uuid: vm(n),
        vcpus: 1,
        memory_mib: 256,
        devices: Vec::new(),
        disk: None,
        nics: vec![NicSpec {
            mac: mac(n),
            ip: format!("10.88.0.{}", 11 + n).parse().unwrap(),
            prefix_len: 24,
            gateway: Some("10.88.0.1".parse().unwrap()),
            resolvers: Vec::new(),
            bridge: BRIDGE.into(),
            vlan_id: 0,
            mtu: 1500,
            primary: true,
        }],
        cloud_init: Some(CloudInitSpec {
            hostname: format!("guest{n}"),
            ssh_authorized_keys: Vec::new(),
            user_data,
            user_script: None,
            metadata: BTreeMap::new(),
        }),
        bootrom: None,
    }
}

fn on_path(tool: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()))
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn each_tap_reaches_only_its_own_vm() {
    if netns::inside().is_some() {
        return inside();
    }
    let missing: Vec<&str> = ["nft", "curl"]
        .into_iter()
        .filter(|t| !on_path(t))
        .collect();
    if !missing.is_empty() {
        assert!(
            std::env::var_os("CI").is_none(),
            "{missing:?} missing (Debian: nftables, curl)"
        );
        eprintln!("note: SKIPPED: {missing:?} not installed");
        return;
    }
    let Some(host) = NetNs::new("meta") else {
        return;
    };
    // The guests' namespaces, made here so that the copy inside finds them by name.
    let guests: Vec<NetNs> = (0..2)
        .map(|n| {
            let name = format!("{}-g{n}", host.name);
            run(Command::new("ip").args(["netns", "add", &name]));
            NetNs { name }
        })
        .collect();
    for (n, g) in guests.iter().enumerate() {
        let tap = tap_name(vm(n), 0);
        run(Command::new("ip").args([
            "link", "add", &tap, "netns", &host.name, "type", "veth", "peer", "name", "eth0",
            "netns", &g.name,
        ]));
        let m = mac(n);
        let ip = format!("10.88.0.{}/24", 11 + n);
        for args in [
            vec!["link", "set", "lo", "up"],
            vec!["link", "set", "eth0", "address", &m, "up"],
            vec!["addr", "add", &ip, "dev", "eth0"],
            // The gateway is not the node: frames to 169.254.169.254 go to its MAC.
            vec![
                "neigh",
                "add",
                "10.88.0.1",
                "lladdr",
                "02:00:00:00:99:99",
                "dev",
                "eth0",
            ],
            vec!["route", "add", "default", "via", "10.88.0.1"],
        ] {
            g.ip_ok(&args);
        }
    }
    let exe = std::env::current_exe().unwrap();
    let status = Command::new("ip")
        .args(["netns", "exec", &host.name])
        .arg(&exe)
        .args([
            "--exact",
            &netns::test_name(module_path!(), "each_tap_reaches_only_its_own_vm"),
            "--nocapture",
            "--test-threads=1",
        ])
        .env("PASSAGE_TEST_NETNS", &host.name)
        .env(
            GUEST_ENV,
            guests
                .iter()
                .map(|g| g.name.as_str())
                .collect::<Vec<_>>()
                .join(","),
        )
        .status()
        .unwrap();
    assert!(status.success(), "inside {}: {status}", host.name);
}

/// `curl` in guest namespace `ns`; its output, or `None` when it failed.
fn curl(ns: &str, url: &str) -> Option<Vec<u8>> {
    let out = Command::new("ip")
        .args(["netns", "exec", ns, "curl", "-sSf", "-m", "3", url])
        .output()
        .unwrap();
    out.status.success().then_some(out.stdout)
}

fn taps(root: &Path) -> Vec<(String, Option<String>)> {
    our_taps(root)
        .unwrap()
        .into_iter()
        .map(|t| {
            let m = master_of(root, &t);
            (t, m)
        })
        .collect()
}

fn inside() {
    let guests: Vec<String> = std::env::var(GUEST_ENV)
        .unwrap()
        .split(',')
        .map(str::to_string)
        .collect();
    run(Command::new("ip").args(["link", "add", BRIDGE, "type", "bridge"]));
    run(Command::new("ip").args(["link", "set", BRIDGE, "up"]));
    for n in 0..2 {
        let tap = tap_name(vm(n), 0);
        run(Command::new("ip").args(["link", "set", &tap, "master", BRIDGE, "up"]));
    }
    // Larger than any window, so the rewritten ports carry many segments each way.
    let big: String = (0..40_000).map(|i| format!("{i:07}\n")).collect();
    let specs = vec![spec(0, Some(big.clone())), spec(1, None)];
    let root = PathBuf::from(HOST_SYSFS);
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
        .block_on(async {
            let mut svc = MetadataService::new(None, root.clone());
            svc.reconcile(specs.clone(), &taps(&root)).await;
            let ports = svc.ports();
            assert_eq!(ports.len(), 2, "{ports:?}");
            let blocking = |f: Box<dyn FnOnce() + Send>| tokio::task::spawn_blocking(f);

            let g = guests.clone();
            blocking(Box::new(move || {
                for (n, ns) in g.iter().enumerate() {
                    // The first answer waits for the host to learn the guest's MAC.
                    for which in ["first", "second"] {
                        let started = Instant::now();
                        let id = curl(ns, "http://169.254.169.254/latest/meta-data/instance-id")
                            .expect("the guest's own instance-id");
                        println!(
                            "guest {n}: {which} instance-id in {:.1} ms (curl included)",
                            started.elapsed().as_secs_f64() * 1000.0
                        );
                        assert_eq!(String::from_utf8(id).unwrap(), vm(n).to_string());
                    }
                }
            }))
            .await
            .unwrap();

            let g = guests.clone();
            let other_port = ports[&tap_name(vm(1), 0)];
            blocking(Box::new(move || {
                let got = curl(&g[0], "http://169.254.169.254/latest/user-data").unwrap();
                assert!(
                    got == big.as_bytes(),
                    "{} bytes came, not {}",
                    got.len(),
                    big.len()
                );
                assert!(curl(&g[1], "http://169.254.169.254/latest/user-data").is_none());
                let md = curl(
                    &g[1],
                    "http://169.254.169.254/openstack/latest/meta_data.json",
                )
                .unwrap();
                let md: serde_json::Value = serde_json::from_slice(&md).unwrap();
                assert_eq!(md["uuid"], vm(1).to_string());
                assert_eq!(md["hostname"], "guest1");
                // The other VM's listener, and the address at any other port: dropped.
                let theirs = format!("http://169.254.169.254:{other_port}/latest/meta-data/");
                assert!(
                    curl(&g[0], &theirs).is_none(),
                    "reached the other VM's port"
                );
                assert!(curl(&g[0], "http://169.254.169.254:81/").is_none());
            }))
            .await
            .unwrap();

            // VM 2 gone (its tap still there): no answer, no chains.
            svc.reconcile(vec![specs[0].clone()], &taps(&root)).await;
            let table = run(Command::new("nft").args(["list", "table", "bridge", "passage"]));
            assert!(!table.contains(&tap_name(vm(1), 0)), "{table}");
            let g = guests.clone();
            blocking(Box::new(move || {
                assert!(
                    curl(&g[1], "http://169.254.169.254/latest/meta-data/instance-id").is_none()
                );
                assert!(
                    curl(&g[0], "http://169.254.169.254/latest/meta-data/instance-id").is_some()
                );
            }))
            .await
            .unwrap();

            // A restarted agent: a new service, new ports, the same answers.
            drop(svc);
            let mut svc = MetadataService::new(None, root.clone());
            svc.reconcile(specs.clone(), &taps(&root)).await;
            let g = guests.clone();
            blocking(Box::new(move || {
                for (n, ns) in g.iter().enumerate() {
                    let id = curl(ns, "http://169.254.169.254/latest/meta-data/instance-id");
                    assert_eq!(id, Some(vm(n).to_string().into_bytes()));
                }
            }))
            .await
            .unwrap();
            drop(svc);
        });
    node_agent::net::nft::remove().unwrap();
}
