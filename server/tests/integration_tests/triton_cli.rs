//! Triton's own `triton` CLI (npm `triton`, the version `xtask/triton-cli` pins; `cargo
//! xtask test` installs it and names it in `PASSAGE_TEST_TRITON`) against the CloudAPI the
//! server answers at `/:login`, with a simulated node: every command a Triton user's GPU
//! workflow needs, checked for its output and its exit status, signed with ed25519,
//! RSA and ECDSA keys.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common::*;
use passage_model::api::{Package, Vm, VmState};
use passage_model::keys::SshKey;
use passage_model::networks::Network;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// The `triton` command; outside CI, or with `PASSAGE_ALLOW_NO_TRITON=1`, its absence
/// skips the test.
pub(super) fn triton_cli() -> Option<PathBuf> {
    let found = std::env::var_os("PASSAGE_TEST_TRITON")
        .map(PathBuf::from)
        .filter(|p| p.is_file());
    if found.is_none() {
        let allowed = std::env::var("PASSAGE_ALLOW_NO_TRITON").as_deref() == Ok("1");
        assert!(
            allowed || std::env::var_os("CI").is_none(),
            "PASSAGE_TEST_TRITON is not set to a file: `cargo xtask test` installs the triton CLI"
        );
        eprintln!("note: SKIPPED: PASSAGE_TEST_TRITON is not set (run `cargo xtask test`)");
    }
    found
}

/// A Triton user on this machine: a home with its SSH keys and a profile in the
/// environment (`TRITON_URL`, `TRITON_ACCOUNT`, `TRITON_KEY_ID`), as the README shows.
pub(super) struct TritonUser {
    pub cli: PathBuf,
    pub home: tempfile::TempDir,
    pub url: String,
    pub account: String,
    /// `-k`: which of its keys signs.
    pub key_id: String,
}

/// What a command printed and how it ended.
#[derive(Debug)]
pub(super) struct Ran {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl Ran {
    #[track_caller]
    pub fn ok(self) -> String {
        assert_eq!(self.code, 0, "{self:#?}");
        self.stdout
    }
}

/// Makes a key with `ssh-keygen` in `dir`; answers its public line and its MD5
/// fingerprint as the CLI names it.
pub(super) fn keygen(dir: &Path, name: &str, args: &[&str]) -> (String, String) {
    let path = dir.join(name);
    let out = Command::new("ssh-keygen")
        .args(["-q", "-N", "", "-C", name])
        .args(args)
        .arg("-f")
        .arg(&path)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let public = std::fs::read_to_string(path.with_extension("pub")).unwrap();
    let out = Command::new("ssh-keygen")
        .args(["-l", "-E", "md5", "-f"])
        .arg(path.with_extension("pub"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let md5 = text
        .split_whitespace()
        .nth(1)
        .and_then(|f| f.strip_prefix("MD5:"))
        .unwrap()
        .to_string();
    (public.trim().to_string(), md5)
}

impl TritonUser {
    /// A user `account` whose `~/.ssh` holds an ed25519 key (`id_ed25519`), signing with
    /// it.
    pub fn new(cli: &Path, url: &str, account: &str) -> (TritonUser, String) {
        let home = tempfile::tempdir().unwrap();
        let ssh = home.path().join(".ssh");
        std::fs::create_dir_all(&ssh).unwrap();
        let (public, md5) = keygen(&ssh, "id_ed25519", &["-t", "ed25519"]);
        (
            TritonUser {
                cli: cli.to_path_buf(),
                home,
                url: url.to_string(),
                account: account.to_string(),
                key_id: md5,
            },
            public,
        )
    }

    pub fn ssh_dir(&self) -> PathBuf {
        self.home.path().join(".ssh")
    }

    pub fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(&self.cli);
        cmd.args(args)
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("HOME", self.home.path())
            .env("TRITON_URL", &self.url)
            .env("TRITON_ACCOUNT", &self.account)
            .env("TRITON_KEY_ID", &self.key_id);
        cmd
    }

    /// Runs `triton ARGS` off the runtime.
    pub async fn run(&self, args: &[&str]) -> Ran {
        let mut cmd = self.command(args);
        let out = tokio::task::spawn_blocking(move || cmd.output().unwrap())
            .await
            .unwrap();
        Ran {
            code: out.status.code().unwrap_or(-1),
            stdout: String::from_utf8_lossy(&out.stdout).to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).to_string(),
        }
    }

    pub async fn json(&self, args: &[&str]) -> Value {
        let out = self.run(args).await.ok();
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("{args:?}: {e}: {out}"))
    }
}

async fn the_triton_cli_drives_passage(backend: Backend) {
    let Some(cli) = triton_cli() else {
        return;
    };
    let mut s = TestServer::start(backend, fast_config()).await;
    let _node = s.add_node(4).await;
    let gpu_1x = s.h100_catalog(1).await;
    let packages: Vec<Package> = s.get("/v1/packages").await.ok(200);
    let package = packages.iter().find(|p| p.name == gpu_1x).unwrap().clone();
    let net: Network = s
        .post(
            "/v1/networks",
            &json!({"name": "tenant-lan", "subnet": "10.60.0.0/24", "gateway": "10.60.0.1",
                    "resolvers": ["10.60.0.1"], "bridge": "br0", "public": true,
                    "default": true}),
        )
        .await
        .ok(201);
    let (alice_uuid, alice_token) = s.tenant("alice").await;
    let alice_api = s.with(&alice_token);
    let (alice, public) = TritonUser::new(&cli, &s.base, "alice");
    // The first key comes through the portal or /v1: CloudAPI is signed with one.
    alice_api
        .post::<SshKey>("/v1/keys", &json!({"name": "laptop", "key": public}))
        .await
        .ok(201);

    // info, packages, images, networks.
    let info = alice.run(&["info"]).await.ok();
    assert!(info.contains("login: alice"), "{info}");
    assert!(info.contains("instances: 0"), "{info}");
    let out = alice.run(&["package", "list"]).await.ok();
    assert!(out.contains(&gpu_1x) && out.contains("4G"), "{out}");
    let got = alice.json(&["package", "get", &gpu_1x]).await;
    assert_eq!(got["id"], package.uuid.to_string());
    assert_eq!(got["memory"], 4096);
    assert_eq!(got["disk"], 10 * 1024);
    assert_eq!(got["devices"], json!({"NVIDIA_H100": 1}));
    let got = alice
        .json(&["package", "get", &package.uuid.to_string()])
        .await;
    assert_eq!(got["name"], gpu_1x);
    let out = alice.run(&["image", "list"]).await.ok();
    assert!(out.contains("test-image") && out.contains(" 1 "), "{out}");
    let out = alice.run(&["network", "list"]).await.ok();
    assert!(out.contains("tenant-lan") && out.contains("true"), "{out}");

    // Keys: an RSA and an ECDSA key added with the CLI, each then signing.
    let (_, rsa_md5) = keygen(&alice.ssh_dir(), "id_rsa", &["-t", "rsa", "-b", "3072"]);
    let out = alice
        .run(&[
            "key",
            "add",
            "-n",
            "rsa-key",
            alice.ssh_dir().join("id_rsa.pub").to_str().unwrap(),
        ])
        .await
        .ok();
    assert!(
        out.contains("Added key \"rsa-key\"") && out.contains(&rsa_md5),
        "{out}"
    );
    let (_, ec_md5) = keygen(&alice.ssh_dir(), "id_ecdsa", &["-t", "ecdsa", "-b", "256"]);
    alice
        .run(&[
            "key",
            "add",
            "-n",
            "ec-key",
            alice.ssh_dir().join("id_ecdsa.pub").to_str().unwrap(),
        ])
        .await
        .ok();
    let out = alice.run(&["key", "list"]).await.ok();
    for want in [
        "laptop",
        "rsa-key",
        "ec-key",
        &rsa_md5,
        &ec_md5,
        &alice.key_id,
    ] {
        assert!(out.contains(want), "{want}: {out}");
    }
    for md5 in [&rsa_md5, &ec_md5] {
        let out = alice.run(&["-k", md5, "account", "get"]).await.ok();
        assert!(out.contains("login: alice"), "{md5}: {out}");
    }
    let got = alice.json(&["key", "get", "-j", "rsa-key"]).await;
    assert_eq!(got["fingerprint"], rsa_md5);
    let got = alice.json(&["key", "get", "-j", &ec_md5]).await;
    assert_eq!(got["name"], "ec-key");
    let out = alice.run(&["key", "delete", "-f", "ec-key"]).await.ok();
    assert!(out.contains("Deleted key \"ec-key\""), "{out}");
    let r = alice.run(&["-k", &ec_md5, "account", "get"]).await;
    assert_eq!(r.code, 1, "a deleted key signs no more: {r:#?}");
    let out = alice.run(&["key", "list"]).await.ok();
    assert!(!out.contains("ec-key"), "{out}");

    // Create by name with metadata, a tag and a network; wait for it to run.
    let out = alice
        .run(&[
            "instance",
            "create",
            "-w",
            "-n",
            "train-1",
            "-m",
            "foo=bar",
            "-m",
            "count=3",
            "-t",
            "role=train",
            "--network",
            "tenant-lan",
            "test-image",
            &gpu_1x,
        ])
        .await;
    if out.code != 0 {
        let vms: Vec<Vm> = alice_api.get("/v1/vms").await.ok(200);
        for v in vms {
            let j: Value = s
                .get(&format!("/v1/jobs/{}", v.job_uuid.unwrap()))
                .await
                .ok(200);
            eprintln!("DEBUG {v:?}\n{j:#}");
        }
    }
    let out = out.ok();
    assert!(
        out.contains("Creating instance train-1") && out.contains("Created instance train-1"),
        "{out}"
    );
    assert!(out.contains(&format!("test-image@1, {gpu_1x}")), "{out}");
    let vms: Vec<Vm> = alice_api.get("/v1/vms").await.ok(200);
    let vm = vms.iter().find(|v| v.alias == "train-1").unwrap().clone();
    assert_eq!(vm.state, VmState::Running);
    assert_eq!(vm.metadata["foo"], "bar");
    assert_eq!(vm.metadata["count"], "3");
    assert_eq!(vm.tags["role"], json!("train"));
    assert_eq!(vm.assigned_devices.len(), 1);
    assert_eq!(vm.nics[0].network_uuid, net.uuid);
    // And by uuid, with no name (the server makes one).
    let image: Vec<Value> = alice_api.get("/v1/images").await.ok(200);
    let image_uuid = image[0]["uuid"].as_str().unwrap().to_string();
    let out = alice
        .run(&[
            "instance",
            "create",
            "-w",
            &image_uuid,
            &package.uuid.to_string(),
        ])
        .await
        .ok();
    assert!(out.contains("Created instance"), "{out}");

    // A fixed address, as `--nic` asks for it.
    let nic = format!("ipv4_uuid={},ipv4_ips=10.60.0.50", net.uuid);
    alice
        .run(&[
            "instance",
            "create",
            "-w",
            "-n",
            "fixed",
            "--nic",
            &nic,
            "test-image",
            &gpu_1x,
        ])
        .await
        .ok();
    let ip = alice.run(&["instance", "ip", "fixed"]).await.ok();
    assert_eq!(ip.trim(), "10.60.0.50");

    // list, get, ip, tag filters.
    let out = alice.run(&["instance", "list"]).await.ok();
    assert_eq!(out.matches("running").count(), 3, "{out}");
    assert!(
        out.contains("train-1") && out.contains("test-image@1"),
        "{out}"
    );
    let out = alice
        .run(&["instance", "list", "-H", "-o", "name", "tag.role=train"])
        .await
        .ok();
    assert_eq!(out.trim(), "train-1");
    let got = alice.json(&["instance", "get", "train-1"]).await;
    assert_eq!(got["id"], vm.uuid.to_string());
    assert_eq!(got["state"], "running");
    assert_eq!(got["package"], gpu_1x);
    assert_eq!(got["memory"], 4096);
    assert_eq!(got["gpus"], 1);
    assert_eq!(got["assigned_devices"], json!([vm.assigned_devices[0]]));
    assert_eq!(got["tags"], json!({"role": "train"}));
    assert_eq!(got["metadata"]["count"], "3");
    let got = alice.json(&["instance", "tag", "list", "train-1"]).await;
    assert_eq!(got, json!({"role": "train"}));
    let out = alice
        .run(&["instance", "tag", "get", "train-1", "role"])
        .await
        .ok();
    assert_eq!(out.trim(), "train");
    // Tags that change: set (typed values), delete one, replace all, each waited on with
    // `-w` (the CLI polls ListMachineTags) and seen through /v1.
    let vm_tags = format!("/v1/vms/{}/tags", vm.uuid);
    alice
        .run(&[
            "instance",
            "tag",
            "set",
            "-w",
            "train-1",
            "gpu=8",
            "owner=ann",
        ])
        .await
        .ok();
    let t: Value = alice_api.get(&vm_tags).await.ok(200);
    assert_eq!(t, json!({"gpu": 8, "owner": "ann", "role": "train"}));
    alice
        .run(&["instance", "tag", "delete", "-w", "train-1", "owner"])
        .await
        .ok();
    let t: Value = alice_api.get(&vm_tags).await.ok(200);
    assert_eq!(t, json!({"gpu": 8, "role": "train"}));
    alice
        .run(&[
            "instance",
            "tag",
            "replace-all",
            "-w",
            "train-1",
            "role=train",
        ])
        .await
        .ok();
    let t: Value = alice_api.get(&vm_tags).await.ok(200);
    assert_eq!(t, json!({"role": "train"}));
    let ip = alice.run(&["instance", "ip", "train-1"]).await.ok();
    assert_eq!(ip.trim(), vm.primary_ip.unwrap().to_string());

    // stop -w, start -w.
    let out = alice.run(&["instance", "stop", "-w", "train-1"]).await.ok();
    assert!(out.contains("Stop instance train-1"), "{out}");
    let v: Vm = alice_api.get(&format!("/v1/vms/{}", vm.uuid)).await.ok(200);
    assert_eq!(v.state, VmState::Stopped);
    let out = alice
        .run(&["instance", "start", "-w", "train-1"])
        .await
        .ok();
    assert!(out.contains("Start instance train-1"), "{out}");
    let v: Vm = alice_api.get(&format!("/v1/vms/{}", vm.uuid)).await.ok(200);
    assert_eq!(v.state, VmState::Running);

    // Another account finds none of it; a key the server does not know is refused.
    let (bob_uuid, bob_token) = s.tenant("bob").await;
    let (bob, bob_public) = TritonUser::new(&cli, &s.base, "bob");
    s.with(&bob_token)
        .post::<SshKey>("/v1/keys", &json!({"key": bob_public}))
        .await
        .ok(201);
    let r = bob.run(&["instance", "get", &vm.uuid.to_string()]).await;
    assert_eq!(r.code, 3, "{r:#?}");
    let info = bob.run(&["info"]).await.ok();
    assert!(info.contains("instances: 0"), "{info}");
    // Bob's key is not alice's; and bob, signing as himself, may not act as alice.
    let mut as_alice = bob.command(&["instance", "list"]);
    as_alice.env("TRITON_ACCOUNT", "alice");
    let out = tokio::task::spawn_blocking(move || as_alice.output().unwrap())
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("InvalidCredentials"),
        "{out:?}"
    );
    let r = bob.run(&["--act-as", "alice", "instance", "list"]).await;
    assert_eq!(r.code, 1, "{r:#?}");
    assert!(r.stderr.contains("NotAuthorized"), "{r:#?}");
    let (_, stranger_md5) = keygen(&bob.ssh_dir(), "id_ecdsa", &["-t", "ecdsa", "-b", "256"]);
    let r = bob.run(&["-k", &stranger_md5, "info"]).await;
    assert_eq!(r.code, 1, "{r:#?}");
    assert!(r.stderr.contains("InvalidCredentials"), "{r:#?}");
    assert_ne!(alice_uuid, bob_uuid);

    // delete -w: the machine reads deleted (410) and its GPU is scrubbed.
    let out = alice
        .run(&["instance", "delete", "-w", "-f", "train-1"])
        .await
        .ok();
    assert!(out.contains("Delete instance train-1"), "{out}");
    let v: Vm = alice_api.get(&format!("/v1/vms/{}", vm.uuid)).await.ok(200);
    assert_eq!(v.state, VmState::Destroyed);
    let r = alice.run(&["instance", "get", &vm.uuid.to_string()]).await;
    assert_eq!(r.code, 3, "{r:#?}");
    assert!(r.stderr.contains("deleted"), "{r:#?}");
    let out = alice
        .run(&["instance", "list", "-H", "-o", "name"])
        .await
        .ok();
    assert_eq!(out.lines().count(), 2, "{out}");

    // Every change is in /v1's audit log under alice's name: here, her three creations.
    let audit: Vec<Value> = s.get("/v1/audit?limit=1000").await.ok(200);
    let posts = audit
        .iter()
        .filter(|e| {
            e["actor_login"] == "alice" && e["method"] == "POST" && e["path"] == "/alice/machines"
        })
        .count();
    assert_eq!(posts, 3, "{audit:#?}");
    wait_for(Duration::from_secs(30), || async {
        let srv: passage_model::api::Server = s
            .get(&format!("/v1/servers/{}", v.server_uuid?))
            .await
            .ok(200);
        let free = srv
            .assignable_devices?
            .iter()
            .filter(|d| d.state == passage_model::DeviceState::Unassigned)
            .count();
        (free == 2).then_some(())
    })
    .await
    .expect("the deleted instance's GPU was scrubbed");
}
both!(triton_cli_workflow, the_triton_cli_drives_passage);

/// The CLI pages through `GET /:login/machines` 1,000 at a time and stops at the first
/// page shorter than that (`x-resource-count` is the page's length): 1,001 instances all
/// show, in `instance list` and in `info`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_triton_cli_pages_past_a_thousand_instances() {
    let Some(cli) = triton_cli() else {
        return;
    };
    let mut s = TestServer::start(Backend::Sqlite, fast_config()).await;
    let opts = node_agent::fake::FakeOptions {
        cpus: Some(1100),
        ..node_agent::fake::FakeOptions::default()
    };
    let _node = s
        .add_node_from(1, node_agent::fake::GpuModel::H100, &opts)
        .await;
    s.image().await;
    s.post::<Package>(
        "/v1/packages",
        &json!({"name": "tiny", "vcpus": 1, "memory_mib": 64, "disk_gib": 1, "devices": {}}),
    )
    .await
    .ok(201);
    let (_, token) = s.tenant("many").await;
    let api = s.with(&token);
    let (user, public) = TritonUser::new(&cli, &s.base, "many");
    api.post::<SshKey>("/v1/keys", &json!({"key": public}))
        .await
        .ok(201);
    const N: usize = 1001;
    for chunk in (0..N).collect::<Vec<_>>().chunks(50) {
        let bodies: Vec<Value> = chunk
            .iter()
            .map(|i| json!({"alias": format!("vm-{i:04}"), "package": "tiny", "image": "test-image"}))
            .collect();
        let creations = bodies.iter().map(|b| api.post::<Vm>("/v1/vms", b));
        for r in futures_util::future::join_all(creations).await {
            r.ok(202);
        }
    }
    let out = user
        .run(&["instance", "list", "-H", "-o", "name"])
        .await
        .ok();
    let mut names: Vec<&str> = out.lines().collect();
    names.sort_unstable();
    names.dedup();
    assert_eq!(names.len(), N, "every instance once");
    let info = user.run(&["info"]).await.ok();
    assert!(info.contains(&format!("instances: {N}")), "{info}");
}
