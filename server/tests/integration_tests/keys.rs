//! SSH keys: an account's own at /v1/keys, any account's for operators at
//! /v1/accounts/{uuid}/keys; parsed, checked and fingerprinted as `ssh-keygen` does.

use crate::common::*;
use passage_model::ErrorCode;
use passage_model::keys::{MAX_KEYS_PER_ACCOUNT, SshKey};
use serde_json::json;

const ED25519: &str =
    "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAICqnk2fvcqLA+0tjyUrHFA6RPpg6Lxa18w94B4M1/Nqv me@laptop";
const RSA_2048: &str = "ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQDoDfUJc2D51d7DpIWsAkDMp5rCqzUglzv8YuS7uL1xs+si7uKLxPfChaJjlDirw5s0A6ABpIHveVmxPbLAJnGVcFb2SpJza6huE6JTtEcdogoh0SRsm0NixXFn2xFEFEloAVmN8CtfX7ujNVmbsPkD1mV17NTBL+u8QMvaP0qf92jlwMBqdBiqExpKKSmPJolKId6GwemmL8rVJ26zJWcnTevv55hioea9vXXTGGronbzr4SanMwOJelrYBU3v3Cjwa+KAhaIyVecngcGCkCOJuKw+Mb9SelAPDmxuNUqqM3UMqdte0Az2mHxqCair7xDp0lt6vLanYdrMVrhiE7qh rsa2048";
const RSA_1024: &str = "ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAAAgQD3Mv8n2ti7kCyrbBm5WRsY8h+SxpNnCYXKAaSmFC8HAVSOwT85XWhVJHy9RiIi9rd9scAwCPsC1NUU7LBelDd9M1vWuI4UUjz/YH6wihWI5e1+i0fHFjX6JxPRVujJppjTHSL8+ocXaxiQdJ9lDz8pDXTqvzyiejptwG0z+uCgGQ== rsa1024";

/// A valid ed25519 key of its own for each `i`.
fn nth_key(i: u32) -> String {
    let mut raw = [7u8; 32];
    raw[..4].copy_from_slice(&i.to_be_bytes());
    let key = ssh_key::PublicKey::from(ssh_key::public::Ed25519PublicKey(raw));
    key.to_openssh().unwrap()
}

async fn own_keys_are_kept_apart(backend: Backend) {
    let s = TestServer::start(backend, fast_config()).await;
    let (alice_uuid, alice) = s.tenant("alice").await;
    let (bob_uuid, bob) = s.tenant("bob").await;
    let alice = s.with(&alice);
    let bob = s.with(&bob);

    let k: SshKey = alice
        .post("/v1/keys", &json!({"key": ED25519}))
        .await
        .ok(201);
    assert_eq!(k.name, "me@laptop");
    assert_eq!(
        k.fingerprint,
        "SHA256:YTlYQAivbUAXrf2tbvJs8Ckf5i5YBCtV2IhGPvNUgjI"
    );
    assert_eq!(
        k.md5_fingerprint,
        "52:84:f6:9d:76:79:e4:e4:d1:9e:96:c5:76:fa:ee:ac"
    );
    // Creation times are in milliseconds, and keys made in the same one list by name:
    // this one is a millisecond newer at least.
    tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    let r = alice
        .post::<SshKey>("/v1/keys", &json!({"name": "work", "key": RSA_2048}))
        .await;
    assert_eq!(
        r.ok(201).fingerprint,
        "SHA256:pae1V6rphiD1wzdwvDxPUeJRf8mOuiWehvNlAzsvqPI"
    );

    let listed = alice.get::<Vec<SshKey>>("/v1/keys").await;
    assert_eq!(listed.header("x-resource-count"), Some("2"));
    let names: Vec<String> = listed.ok(200).into_iter().map(|k| k.name).collect();
    assert_eq!(names, ["work", "me@laptop"], "newest first");
    let got: SshKey = alice.get("/v1/keys/me@laptop").await.ok(200);
    assert_eq!(got.key, ED25519);

    // The same name, or the same key under another name: refused, nothing changed.
    alice
        .post::<SshKey>("/v1/keys", &json!({"name": "work", "key": nth_key(1)}))
        .await
        .fails(409, ErrorCode::Conflict);
    alice
        .post::<SshKey>("/v1/keys", &json!({"name": "again", "key": ED25519}))
        .await
        .fails(409, ErrorCode::Conflict);
    // What is not an accepted key says why.
    let e = alice
        .post::<SshKey>("/v1/keys", &json!({"key": RSA_1024}))
        .await
        .invalid("key");
    assert!(e.message.contains("1024 bits"), "{}", e.message);
    alice
        .post::<SshKey>("/v1/keys", &json!({"key": "not a key"}))
        .await
        .invalid("key");
    alice
        .post::<SshKey>("/v1/keys", &json!({"name": "", "key": nth_key(2)}))
        .await
        .invalid("name");
    assert_eq!(alice.get::<Vec<SshKey>>("/v1/keys").await.ok(200).len(), 2);

    // Another tenant's keys do not exist for bob, by either path.
    assert!(bob.get::<Vec<SshKey>>("/v1/keys").await.ok(200).is_empty());
    bob.get::<SshKey>("/v1/keys/me@laptop")
        .await
        .fails(404, ErrorCode::ResourceNotFound);
    let theirs = format!("/v1/accounts/{alice_uuid}/keys");
    bob.get::<Vec<SshKey>>(&theirs)
        .await
        .fails(404, ErrorCode::ResourceNotFound);
    bob.post::<SshKey>(&theirs, &json!({"key": nth_key(3)}))
        .await
        .fails(404, ErrorCode::ResourceNotFound);
    bob.delete::<()>(&format!("{theirs}/work"))
        .await
        .fails(404, ErrorCode::ResourceNotFound);
    // The same key may sit on two accounts.
    bob.post::<SshKey>("/v1/keys", &json!({"key": ED25519}))
        .await
        .ok(201);
    // Bob's own account by its uuid is his to use.
    bob.get::<Vec<SshKey>>(&format!("/v1/accounts/{bob_uuid}/keys"))
        .await
        .ok(200);

    alice.delete::<()>("/v1/keys/work").await.ok(204);
    alice
        .delete::<()>("/v1/keys/work")
        .await
        .fails(404, ErrorCode::ResourceNotFound);
    assert_eq!(alice.get::<Vec<SshKey>>("/v1/keys").await.ok(200).len(), 1);
}
both!(own_keys_are_kept_apart, own_keys_are_kept_apart);

async fn operators_manage_any_accounts_keys_and_readers_only_read(backend: Backend) {
    let s = TestServer::start(backend, fast_config()).await;
    let (alice_uuid, alice) = s.tenant("alice").await;
    let op = s.as_admin();
    let path = format!("/v1/accounts/{alice_uuid}/keys");
    op.post::<SshKey>(&path, &json!({"name": "given", "key": ED25519}))
        .await
        .ok(201);
    let mine: Vec<SshKey> = s.with(&alice).get("/v1/keys").await.ok(200);
    assert_eq!(mine.len(), 1);
    assert_eq!(mine[0].name, "given");
    assert_eq!(op.get::<Vec<SshKey>>(&path).await.ok(200).len(), 1);
    op.get::<SshKey>(&format!("{path}/given")).await.ok(200);

    let ro = s.with(&s.reader("ro").await);
    assert_eq!(ro.get::<Vec<SshKey>>(&path).await.ok(200).len(), 1);
    ro.post::<SshKey>(&path, &json!({"key": nth_key(1)}))
        .await
        .fails(403, ErrorCode::Forbidden);
    ro.delete::<()>(&format!("{path}/given"))
        .await
        .fails(403, ErrorCode::Forbidden);
    let nobody = format!("/v1/accounts/{}/keys", uuid::Uuid::new_v4());
    op.get::<Vec<SshKey>>(&nobody)
        .await
        .fails(404, ErrorCode::ResourceNotFound);
    // As for any object: what is not a uuid names nothing.
    op.get::<Vec<SshKey>>("/v1/accounts/not-a-uuid/keys")
        .await
        .fails(404, ErrorCode::ResourceNotFound);

    op.delete::<()>(&format!("{path}/given")).await.ok(204);
    assert!(
        s.with(&alice)
            .get::<Vec<SshKey>>("/v1/keys")
            .await
            .ok(200)
            .is_empty()
    );

    // Keys go with their account.
    s.with(&alice)
        .post::<SshKey>("/v1/keys", &json!({"key": ED25519}))
        .await
        .ok(201);
    op.delete::<()>(&format!("/v1/accounts/{alice_uuid}"))
        .await
        .ok(204);
}
both!(
    operators_manage_any_accounts_keys_and_readers_only_read,
    operators_manage_any_accounts_keys_and_readers_only_read
);

async fn an_account_holds_a_bounded_number_of_keys(backend: Backend) {
    let s = TestServer::start(backend, fast_config()).await;
    let (_, t) = s.tenant("many").await;
    let t = s.with(&t);
    for i in 0..u32::try_from(MAX_KEYS_PER_ACCOUNT).unwrap() {
        t.post::<SshKey>(
            "/v1/keys",
            &json!({"name": format!("k{i}"), "key": nth_key(i)}),
        )
        .await
        .ok(201);
    }
    let e = t
        .post::<SshKey>(
            "/v1/keys",
            &json!({"name": "one-more", "key": nth_key(1000)}),
        )
        .await
        .fails(409, ErrorCode::Conflict);
    assert!(e.message.contains("at most"), "{}", e.message);
    let page = t.get::<Vec<SshKey>>("/v1/keys?limit=10").await;
    assert_eq!(
        page.header("x-resource-count"),
        Some(MAX_KEYS_PER_ACCOUNT.to_string().as_str())
    );
    assert_eq!(page.ok(200).len(), 10);
}
both!(
    an_account_holds_a_bounded_number_of_keys,
    an_account_holds_a_bounded_number_of_keys
);

/// `POST /v1/vms` with `keys`: a VM given one of its owner's two keys (by name, or by
/// fingerprint) lists only that one and its seed, as its node receives it, trusts only
/// that one, even after the account's key is deleted; a VM given none chosen gets both,
/// oldest first; a key the owner does not have, or one given twice, is a 400 naming the
/// entry.
async fn a_vm_gets_the_keys_chosen_for_it(backend: Backend) {
    use passage_model::api::Vm;
    use passage_model::keys::VmKey;
    use passage_model::protocol::{Task, TaskEnvelope, TaskResult};
    let s = TestServer::start(backend, fast_config()).await;
    let (_, cred, _) = s.manual_node(3).await;
    s.h100_catalog(1).await;
    let (_, alice) = s.tenant("alice").await;
    let (_, bob) = s.tenant("bob").await;
    let alice = s.with(&alice);
    let one: SshKey = alice
        .post("/v1/keys", &json!({"key": nth_key(1), "name": "k-one"}))
        .await
        .ok(201);
    let two: SshKey = alice
        .post("/v1/keys", &json!({"key": nth_key(2), "name": "k-two"}))
        .await
        .ok(201);
    s.with(&bob)
        .post::<SshKey>("/v1/keys", &json!({"key": nth_key(3), "name": "bobs"}))
        .await
        .ok(201);
    let create = |alias: &str, keys: Option<Vec<String>>| {
        let mut body = json!({"alias": alias, "package": "gpu-1x", "image": "test-image"});
        if let Some(k) = keys {
            body["keys"] = json!(k);
        }
        body
    };
    let listed = |k: &SshKey| VmKey {
        name: k.name.clone(),
        fingerprint: k.fingerprint.clone(),
    };

    // Refused before anything is placed.
    alice
        .post::<Vm>(
            "/v1/vms",
            &create("bad", Some(vec!["k-one".into(), "nope".into()])),
        )
        .await
        .invalid("keys[1]");
    alice
        .post::<Vm>("/v1/vms", &create("bad", Some(vec!["bobs".into()])))
        .await
        .invalid("keys[0]");
    alice
        .post::<Vm>(
            "/v1/vms",
            &create("bad", Some(vec!["k-one".into(), one.fingerprint.clone()])),
        )
        .await
        .invalid("keys[1]");
    alice
        .post::<Vm>("/v1/vms", &create("bad", Some(vec![String::new()])))
        .await
        .invalid("keys[0]");

    let by_name: Vm = alice
        .post("/v1/vms", &create("by-name", Some(vec!["k-one".into()])))
        .await
        .ok(202);
    assert_eq!(by_name.keys, Some(vec![listed(&one)]));
    let by_print: Vm = alice
        .post(
            "/v1/vms",
            &create("by-print", Some(vec![two.md5_fingerprint.clone()])),
        )
        .await
        .ok(202);
    assert_eq!(by_print.keys, Some(vec![listed(&two)]));
    let all: Vm = alice.post("/v1/vms", &create("all", None)).await.ok(202);
    assert_eq!(all.keys, Some(vec![listed(&one), listed(&two)]));
    let got: Vm = alice
        .get(&format!("/v1/vms/{}", by_name.uuid))
        .await
        .ok(200);
    assert_eq!(got.keys, Some(vec![listed(&one)]));

    // The VM keeps what it was given, whatever becomes of the account's key.
    alice
        .delete::<serde::de::IgnoredAny>("/v1/keys/k-one")
        .await
        .ok(204);

    // What the node is told to boot.
    let node = s.client(Some(&cred));
    let mut seeds = std::collections::BTreeMap::new();
    for _ in 0..60 {
        if seeds.len() == 3 {
            break;
        }
        let tasks: Vec<TaskEnvelope> = node
            .get("/agent/v1/tasks?wait=1&runs=boot_vm")
            .await
            .ok(200);
        for t in tasks {
            // One task for the whole boot, or the launch among separate ones, by when the
            // node's poll said what it runs.
            if let Task::BootVm { vm, .. } | Task::StartVm { vm } = &t.task {
                let keys = vm.cloud_init.as_ref().unwrap().ssh_authorized_keys.clone();
                seeds.insert(vm.uuid, keys);
            }
            node.post::<()>(
                &format!("/agent/v1/tasks/{}/result", t.id),
                &TaskResult::success(),
            )
            .await
            .ok(204);
        }
    }
    assert_eq!(seeds.len(), 3, "{seeds:?}");
    assert_eq!(seeds[&by_name.uuid], vec![one.key.clone()]);
    assert_eq!(seeds[&by_print.uuid], vec![two.key.clone()]);
    assert_eq!(seeds[&all.uuid], vec![one.key.clone(), two.key.clone()]);
}

both!(chosen_keys, a_vm_gets_the_keys_chosen_for_it);
