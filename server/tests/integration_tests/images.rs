//! The image catalog and its files: records, uploads (checked, atomic, one at a time),
//! downloads for clients and for nodes (with ranges), tenant visibility.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common::{Backend, TestServer, fast_config, test_image_bytes, wait_for};
use passage_model::images::{Image, ImageState};
use passage_model::{ErrorCode, ImageId};
use serde_json::json;
use sha2::Digest;
use std::time::Duration;
use tokio::io::AsyncWriteExt;

fn sha_hex(b: &[u8]) -> String {
    hex::encode(sha2::Sha256::digest(b))
}

async fn new_image(s: &TestServer, name: &str, version: &str, ty: &str) -> Image {
    s.post(
        "/v1/images",
        &json!({"name": name, "version": version, "os": "linux", "type": ty,
                "public": true, "tags": {"default_user": "debian"},
                "requirements": {"min_disk_gib": 5}}),
    )
    .await
    .ok(201)
}

fn image_dir(s: &TestServer) -> std::path::PathBuf {
    s.ctx.cfg.image_dir.clone().unwrap()
}

/// Names in the image directory (files and temporaries).
fn dir_entries(s: &TestServer) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(image_dir(s))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// A qcow2 v3 header followed by some bytes: enough for the server's format check.
fn qcow2_bytes() -> Vec<u8> {
    let mut b = b"QFI\xfb\x00\x00\x00\x03".to_vec();
    b.extend((0..4096u32).map(|i| (i % 7) as u8));
    b
}

async fn catalog_crud(b: Backend) {
    let s = TestServer::start(b, fast_config()).await;
    let img = new_image(&s, "debian", "12", "qcow2").await;
    assert_eq!(img.state, ImageState::Unactivated);
    assert_eq!(img.size, None);
    assert_eq!(img.requirements.min_disk_gib, Some(5));
    assert_eq!(img.tags["default_user"], "debian");
    // The same name and version twice: a conflict.
    s.post::<Image>(
        "/v1/images",
        &json!({"name":"debian","version":"12","os":"linux","type":"qcow2"}),
    )
    .await
    .fails(409, ErrorCode::Conflict);
    s.post::<Image>(
        "/v1/images",
        &json!({"name":"de@b","version":"12","os":"linux","type":"qcow2"}),
    )
    .await
    .invalid("name");
    s.post::<Image>(
        "/v1/images",
        &json!({"name":"x","version":"1","os":"linux","type":"vmdk"}),
    )
    .await
    .err(400);
    // The upload makes it active, with its digest and size.
    let bytes = qcow2_bytes();
    let up: Image = s
        .as_admin()
        .put_bytes(
            &format!("/v1/images/{}/file", img.uuid),
            bytes.clone(),
            Some(&sha_hex(&bytes)),
        )
        .await
        .ok(200);
    assert_eq!(up.state, ImageState::Active);
    assert_eq!(up.size, Some(bytes.len() as u64));
    assert_eq!(up.sha256.as_ref().unwrap().as_str(), sha_hex(&bytes));
    assert!(up.published_at.is_some());
    assert_eq!(dir_entries(&s), vec![sha_hex(&bytes)]);
    // A second upload to an active image: refused, the file stays.
    s.as_admin()
        .put_bytes::<Image>(
            &format!("/v1/images/{}/file", img.uuid),
            bytes.clone(),
            None,
        )
        .await
        .fails(409, ErrorCode::InvalidState);
    // The file comes back byte for byte, with its length.
    let r = s
        .client(Some(&s.admin))
        .get_raw(&format!("/v1/images/{}/file", img.uuid), None)
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.content_length(), Some(bytes.len() as u64));
    assert_eq!(r.bytes().await.unwrap().to_vec(), bytes);
    // Patch.
    let p: Image = s
        .patch(
            &format!("/v1/images/{}", img.uuid),
            &json!({"description": "Debian 12", "requirements": {"min_disk_gib": 8}}),
        )
        .await
        .ok(200);
    assert_eq!(p.description.as_deref(), Some("Debian 12"));
    assert_eq!(p.requirements.min_disk_gib, Some(8));
    assert!(p.public);
    s.patch::<Image>(&format!("/v1/images/{}", img.uuid), &json!({"name": "x"}))
        .await
        .err(400);
    // Filters.
    let other = new_image(&s, "ubuntu", "24.04", "raw").await;
    let all: Vec<Image> = s.get("/v1/images").await.ok(200);
    assert_eq!(all.len(), 2);
    assert_eq!(all[0].uuid, other.uuid, "newest first");
    for (q, want) in [
        ("name=debian", vec![img.uuid]),
        ("version=24.04", vec![other.uuid]),
        ("state=active", vec![img.uuid]),
        ("state=unactivated", vec![other.uuid]),
        ("os=linux&name=ubuntu", vec![other.uuid]),
        ("os=windows", vec![]),
    ] {
        let got: Vec<Image> = s.get(&format!("/v1/images?{q}")).await.ok(200);
        assert_eq!(got.iter().map(|i| i.uuid).collect::<Vec<_>>(), want, "{q}");
    }
    s.get::<Vec<Image>>("/v1/images?state=nonsense")
        .await
        .err(400);
    // Delete: no VM used it, so the record and its file go.
    s.delete::<()>(&format!("/v1/images/{}", img.uuid))
        .await
        .ok(204);
    s.get::<Image>(&format!("/v1/images/{}", img.uuid))
        .await
        .fails(404, ErrorCode::ResourceNotFound);
    assert!(dir_entries(&s).is_empty());
    // Writes are in the audit log.
    let audit: Vec<serde_json::Value> = s.get("/v1/audit").await.ok(200);
    assert!(
        audit
            .iter()
            .any(|a| a["path"].as_str().is_some_and(|p| p.ends_with("/file")))
    );
}
crate::both!(catalog_crud, catalog_crud);

async fn shared_files(b: Backend) {
    let s = TestServer::start(b, fast_config()).await;
    let bytes = test_image_bytes();
    let a = new_image(&s, "a", "1", "raw").await;
    let c = new_image(&s, "c", "1", "raw").await;
    for i in [&a, &c] {
        s.as_admin()
            .put_bytes::<Image>(&format!("/v1/images/{}/file", i.uuid), bytes.clone(), None)
            .await
            .ok(200);
    }
    // One file for both.
    assert_eq!(dir_entries(&s), vec![sha_hex(&bytes)]);
    s.delete::<()>(&format!("/v1/images/{}", a.uuid))
        .await
        .ok(204);
    assert_eq!(dir_entries(&s), vec![sha_hex(&bytes)], "c still needs it");
    s.delete::<()>(&format!("/v1/images/{}", c.uuid))
        .await
        .ok(204);
    assert!(dir_entries(&s).is_empty());
}
crate::both!(shared_files, shared_files);

async fn bad_uploads_leave_nothing(b: Backend) {
    let s = TestServer::start(b, fast_config()).await;
    let img = new_image(&s, "debian", "12", "qcow2").await;
    let path = format!("/v1/images/{}/file", img.uuid);
    let bytes = qcow2_bytes();
    // A wrong checksum.
    let e = s
        .as_admin()
        .put_bytes::<Image>(&path, bytes.clone(), Some(&"0".repeat(64)))
        .await
        .invalid("x-content-sha256");
    assert!(e.message.contains(&sha_hex(&bytes)), "{e:?}");
    s.as_admin()
        .put_bytes::<Image>(&path, bytes.clone(), Some("nothex"))
        .await
        .invalid("x-content-sha256");
    // Not qcow2.
    s.as_admin()
        .put_bytes::<Image>(&path, test_image_bytes(), None)
        .await
        .invalid("type");
    let got: Image = s.get(&format!("/v1/images/{}", img.uuid)).await.ok(200);
    assert_eq!(got.state, ImageState::Failed);
    assert_eq!(got.sha256, None);
    assert!(dir_entries(&s).is_empty(), "{:?}", dir_entries(&s));
    // raw: neither empty nor qcow2.
    let raw = new_image(&s, "raw", "1", "raw").await;
    let raw_path = format!("/v1/images/{}/file", raw.uuid);
    s.as_admin()
        .put_bytes::<Image>(&raw_path, Vec::new(), None)
        .await
        .invalid("type");
    s.as_admin()
        .put_bytes::<Image>(&raw_path, bytes.clone(), None)
        .await
        .invalid("type");
    // A failed image takes a good upload.
    let ok: Image = s
        .as_admin()
        .put_bytes(&path, bytes.clone(), Some(&sha_hex(&bytes)))
        .await
        .ok(200);
    assert_eq!(ok.state, ImageState::Active);
    // Tenants may not upload or create.
    let (_, t) = s.tenant("alice").await;
    s.with(&t)
        .put_bytes::<Image>(&raw_path, test_image_bytes(), None)
        .await
        .fails(403, ErrorCode::Forbidden);
    s.with(&t)
        .post::<Image>(
            "/v1/images",
            &json!({"name":"mine","version":"1","os":"linux","type":"raw"}),
        )
        .await
        .fails(403, ErrorCode::Forbidden);
}
crate::both!(bad_uploads_leave_nothing, bad_uploads_leave_nothing);

/// Starts an upload of `total` bytes over a raw connection and sends `sent` of them; the
/// connection stays open until the stream is dropped.
async fn partial_upload(
    s: &TestServer,
    uuid: ImageId,
    total: usize,
    sent: usize,
) -> tokio::net::TcpStream {
    let addr = s.base.strip_prefix("http://").unwrap();
    let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "PUT /v1/images/{uuid}/file HTTP/1.1\r\nHost: {addr}\r\n\
         Authorization: Bearer {}\r\nContent-Type: application/octet-stream\r\n\
         Content-Length: {total}\r\n\r\n",
        s.admin
    );
    c.write_all(head.as_bytes()).await.unwrap();
    c.write_all(&vec![7u8; sent]).await.unwrap();
    c.flush().await.unwrap();
    c
}

async fn interrupted_and_concurrent_uploads(b: Backend) {
    let s = TestServer::start(b, fast_config()).await;
    let img = new_image(&s, "big", "1", "raw").await;
    let path = format!("/v1/images/{}/file", img.uuid);
    let conn = partial_upload(&s, img.uuid, 8 << 20, 4 << 20).await;
    // Its temporary file appears: the upload holds the image.
    wait_for(Duration::from_secs(10), || async {
        (!dir_entries(&s).is_empty()).then_some(())
    })
    .await
    .expect("the upload started");
    // A second upload meanwhile: 409.
    s.as_admin()
        .put_bytes::<Image>(&path, test_image_bytes(), None)
        .await
        .fails(409, ErrorCode::Conflict);
    // The client goes away mid-body: no file, no active image, and the claim is
    // given back (a new upload succeeds).
    drop(conn);
    wait_for(Duration::from_secs(10), || async {
        dir_entries(&s).is_empty().then_some(())
    })
    .await
    .unwrap_or_else(|| panic!("the half file stayed: {:?}", dir_entries(&s)));
    let got: Image = s.get(&format!("/v1/images/{}", img.uuid)).await.ok(200);
    assert_eq!(got.state, ImageState::Unactivated);
    let ok = wait_for(Duration::from_secs(10), || async {
        let r = s
            .as_admin()
            .put_bytes::<Image>(&path, test_image_bytes(), None)
            .await;
        (r.status == 200).then_some(())
    })
    .await;
    assert!(ok.is_some(), "the claim was given back");
}
crate::both!(
    interrupted_and_concurrent_uploads,
    interrupted_and_concurrent_uploads
);

async fn large_upload_streams(b: Backend) {
    let s = TestServer::start(b, fast_config()).await;
    let img = new_image(&s, "large", "1", "raw").await;
    // 64 MiB: far above the API's 64 KiB body limit.
    let bytes: Vec<u8> = (0..64u32 << 20).map(|i| (i % 253) as u8).collect();
    let sha = sha_hex(&bytes);
    let up: Image = s
        .as_admin()
        .put_bytes(&format!("/v1/images/{}/file", img.uuid), bytes, Some(&sha))
        .await
        .ok(200);
    assert_eq!(up.size, Some(64 << 20));
}
crate::both!(large_upload_streams, large_upload_streams);

async fn tenant_visibility(b: Backend) {
    let s = TestServer::start(b, fast_config()).await;
    let (alice, t) = s.tenant("alice").await;
    let (_, bob) = s.tenant("bob").await;
    let public = new_image(&s, "pub", "1", "raw").await;
    let unactivated = new_image(&s, "pending", "1", "raw").await;
    let private: Image = s
        .post(
            "/v1/images",
            &json!({"name":"alices","version":"1","os":"linux","type":"raw",
                    "owner_uuid": alice}),
        )
        .await
        .ok(201);
    for i in [&public, &private] {
        s.as_admin()
            .put_bytes::<Image>(
                &format!("/v1/images/{}/file", i.uuid),
                test_image_bytes(),
                None,
            )
            .await
            .ok(200);
    }
    let seen = |tok: String| {
        let c = s.with(&tok);
        async move {
            let mut v: Vec<String> = c
                .get::<Vec<Image>>("/v1/images")
                .await
                .ok(200)
                .into_iter()
                .map(|i| i.name)
                .collect();
            v.sort();
            v
        }
    };
    assert_eq!(seen(t.clone()).await, vec!["alices", "pub"]);
    assert_eq!(seen(bob.clone()).await, vec!["pub"]);
    s.with(&bob)
        .get::<Image>(&format!("/v1/images/{}", private.uuid))
        .await
        .fails(404, ErrorCode::ResourceNotFound);
    s.with(&bob)
        .get::<Image>(&format!("/v1/images/{}", unactivated.uuid))
        .await
        .fails(404, ErrorCode::ResourceNotFound);
    let r = s
        .client(Some(&bob))
        .get_raw(&format!("/v1/images/{}/file", private.uuid), None)
        .await;
    assert_eq!(r.status(), 404);
    s.with(&t)
        .patch::<Image>(
            &format!("/v1/images/{}", private.uuid),
            &json!({"public": true}),
        )
        .await
        .fails(403, ErrorCode::Forbidden);
    s.with(&t)
        .delete::<()>(&format!("/v1/images/{}", private.uuid))
        .await
        .fails(403, ErrorCode::Forbidden);
}
crate::both!(tenant_visibility, tenant_visibility);

async fn agent_download_with_ranges(b: Backend) {
    let s = TestServer::start(b, fast_config()).await;
    let (_, cred, _) = s.manual_node(1).await;
    let bytes = test_image_bytes();
    let sha = sha_hex(&bytes);
    let agent = s.client(Some(&cred));
    let path = format!("/agent/v1/images/{sha}");
    // Unknown until an image has it.
    assert_eq!(agent.get_raw(&path, None).await.status(), 404);
    s.image().await;
    // Users' tokens are no node credentials.
    assert_eq!(
        s.client(Some(&s.admin)).get_raw(&path, None).await.status(),
        401
    );
    let whole = agent.get_raw(&path, None).await;
    assert_eq!(whole.status(), 200);
    assert_eq!(whole.bytes().await.unwrap().to_vec(), bytes);
    // Resume from an offset.
    let from = 300_000usize;
    let r = agent.get_raw(&path, Some(&format!("bytes={from}-"))).await;
    assert_eq!(r.status(), 206);
    assert_eq!(
        r.headers()["content-range"],
        format!("bytes {from}-{}/{}", bytes.len() - 1, bytes.len()).as_str()
    );
    assert_eq!(r.bytes().await.unwrap().to_vec(), bytes[from..]);
    let r = agent.get_raw(&path, Some("bytes=10-19")).await;
    assert_eq!(r.status(), 206);
    assert_eq!(r.bytes().await.unwrap().to_vec(), bytes[10..20]);
    for bad in [
        format!("bytes={}-", bytes.len()),
        "bytes=9-3".into(),
        "pages=1-".into(),
    ] {
        let r = agent.get_raw(&path, Some(&bad)).await;
        assert_eq!(r.status(), 416, "{bad}");
    }
    assert_eq!(
        agent
            .get_raw(&format!("/agent/v1/images/{}", "x".repeat(64)), None)
            .await
            .status(),
        404
    );
}
crate::both!(agent_download_with_ranges, agent_download_with_ranges);

async fn upload(s: &TestServer, img: &Image, bytes: Vec<u8>) -> Image {
    s.as_admin()
        .put_bytes(&format!("/v1/images/{}/file", img.uuid), bytes, None)
        .await
        .ok(200)
}

async fn vms_from_images(b: Backend) {
    use passage_model::api::{JobState, Vm, VmState};
    let mut s = TestServer::start(b, fast_config()).await;
    let node = s.add_node(2).await;
    let other_node = s.add_node(2).await;
    s.h100_catalog(1).await; // disk_gib 10
    let (_, t) = s.tenant("alice").await;
    let tc = s.with(&t);
    // No image: 400 naming it.
    tc.post::<Vm>("/v1/vms", &json!({"alias": "a", "package": "gpu-1x"}))
        .await
        .invalid("image");
    // Too small a disk for the image: 409.
    let big = new_image(&s, "big", "1", "raw").await;
    s.patch::<Image>(
        &format!("/v1/images/{}", big.uuid),
        &json!({"requirements": {"min_disk_gib": 20}}),
    )
    .await
    .ok(200);
    upload(&s, &big, test_image_bytes()).await;
    tc.post::<Vm>(
        "/v1/vms",
        &json!({"alias": "a", "package": "gpu-1x", "image": "big"}),
    )
    .await
    .fails(409, ErrorCode::Conflict);
    // By name (newest published version), name@version, uuid.
    let v1 = new_image(&s, "debian", "1", "raw").await;
    let v2 = new_image(&s, "debian", "2", "raw").await;
    // Bytes of their own: the harness's image (still active) shares no file with them.
    let deb = vec![0x5au8; 64 * 1024];
    upload(&s, &v1, deb.clone()).await;
    tokio::time::sleep(Duration::from_millis(5)).await;
    let v2 = upload(&s, &v2, deb).await;
    let unready = new_image(&s, "debian", "3", "raw").await;
    let mut made = Vec::new();
    for (key, want) in [
        ("debian".to_string(), v2.uuid),
        ("debian@1".to_string(), v1.uuid),
        (v1.uuid.to_string(), v1.uuid),
    ] {
        let vm: Vm = tc
            .post(
                "/v1/vms",
                &json!({"alias": format!("vm{}", made.len()), "package": "gpu-1x", "image": key}),
            )
            .await
            .ok(202);
        assert_eq!(vm.image_uuid, Some(want), "{key}");
        made.push(vm);
    }
    // Not active, not there, not the tenant's: 404 naming the field.
    for key in [
        format!("debian@{}", unready.version),
        "nothing".into(),
        unready.uuid.to_string(),
    ] {
        tc.post::<Vm>(
            "/v1/vms",
            &json!({"alias": "x", "package": "gpu-1x", "image": key}),
        )
        .await
        .missing("image");
    }
    // The provision ran fetch_image before launch.
    let vm = made.remove(0);
    let job = s.wait_job(vm.job_uuid.unwrap()).await;
    assert_eq!(job.state, JobState::Succeeded, "{job:?}");
    let names: Vec<&str> = job.steps.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(
        names,
        ["reserve", "bind", "fetch_image", "launch", "mark_used"]
    );
    for v in &made {
        s.wait_job(v.job_uuid.unwrap()).await;
    }
    let got: Vm = tc.get(&format!("/v1/vms/{}", vm.uuid)).await.ok(200);
    assert_eq!(got.image_uuid, Some(v2.uuid));
    // Staff see how many live VMs each image has, in the list and on the image; tenants
    // do not (other tenants' VMs are no business of theirs).
    let listed: Vec<Image> = s.get("/v1/images?name=debian").await.ok(200);
    let count = |u: ImageId| listed.iter().find(|i| i.uuid == u).and_then(|i| i.vm_count);
    assert_eq!(count(v1.uuid), Some(2));
    assert_eq!(count(v2.uuid), Some(1));
    assert_eq!(count(unready.uuid), Some(0));
    let one: Image = s.get(&format!("/v1/images/{}", v1.uuid)).await.ok(200);
    assert_eq!(one.vm_count, Some(2));
    let seen: Image = tc.get(&format!("/v1/images/{}", v1.uuid)).await.ok(200);
    assert_eq!(seen.vm_count, None);
    let theirs: Vec<Image> = tc.get("/v1/images?name=debian").await.ok(200);
    assert!(theirs.iter().all(|i| i.vm_count.is_none()), "{theirs:?}");
    // And which VMs those are.
    let from_v1: Vec<Vm> = s
        .get(&format!("/v1/vms?image_uuid={}", v1.uuid))
        .await
        .ok(200);
    let mut want: Vec<_> = made.iter().map(|v| v.uuid).collect();
    want.sort();
    let mut got_uuids: Vec<_> = from_v1.iter().map(|v| v.uuid).collect();
    got_uuids.sort();
    assert_eq!(got_uuids, want);
    s.get::<Vec<Vm>>("/v1/vms?image_uuid=nope")
        .await
        .invalid("image_uuid");
    // Stop, then: no migration (the disk lives on its node); start fetches again.
    let stopped: Vm = tc
        .post_empty(&format!("/v1/vms/{}/stop", vm.uuid))
        .await
        .ok(202);
    s.wait_job(stopped.job_uuid.unwrap()).await;
    let target = if got.server_uuid == Some(node.uuid) {
        other_node.uuid
    } else {
        node.uuid
    };
    let e = s
        .post::<Vm>(
            &format!("/v1/vms/{}/migrate", vm.uuid),
            &json!({"server_uuid": target}),
        )
        .await
        .fails(409, ErrorCode::InvalidState);
    assert!(e.message.contains("disk"), "{e:?}");
    let started: Vm = tc
        .post_empty(&format!("/v1/vms/{}/start", vm.uuid))
        .await
        .ok(202);
    let job = s.wait_job(started.job_uuid.unwrap()).await;
    assert_eq!(job.state, JobState::Succeeded, "{job:?}");
    let names: Vec<&str> = job.steps.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["bind", "fetch_image", "launch"]);
    // Deleting an image VMs were built from disables it; its file stays while they live.
    let sha = v2.sha256.clone().unwrap();
    s.delete::<()>(&format!("/v1/images/{}", v2.uuid))
        .await
        .ok(204);
    let d: Image = s.get(&format!("/v1/images/{}", v2.uuid)).await.ok(200);
    assert_eq!(d.state, ImageState::Disabled);
    // v1 shares the bytes; delete it too (also used: disabled).
    s.delete::<()>(&format!("/v1/images/{}", v1.uuid))
        .await
        .ok(204);
    s.delete::<()>(&format!("/v1/images/{}", big.uuid))
        .await
        .ok(204);
    let file = image_dir(&s).join(sha.as_str());
    assert!(file.exists(), "VMs still use it");
    // A disabled image is no choice for new VMs.
    tc.post::<Vm>(
        "/v1/vms",
        &json!({"alias": "late", "package": "gpu-1x", "image": "debian@2"}),
    )
    .await
    .missing("image");
    // The destroy deletes the disk; once the last VM is gone, the file goes.
    let all = [vec![vm], made].concat();
    for (i, v) in all.iter().enumerate() {
        let gone: Vm = tc.delete(&format!("/v1/vms/{}", v.uuid)).await.ok(202);
        let job = s.wait_job(gone.job_uuid.unwrap()).await;
        assert_eq!(job.state, JobState::Succeeded, "{job:?}");
        let names: Vec<&str> = job.steps.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["stop", "unbind", "delete_disk", "release", "scrub"]);
        let after: Vm = tc.get(&format!("/v1/vms/{}", v.uuid)).await.ok(200);
        assert_eq!(after.state, VmState::Destroyed);
        assert_eq!(file.exists(), i + 1 < all.len(), "after destroy {i}");
    }
    // Destroyed VMs use no image.
    let listed: Vec<Image> = s.get("/v1/images?name=debian").await.ok(200);
    assert!(listed.iter().all(|i| i.vm_count == Some(0)), "{listed:?}");
}
crate::both!(vms_from_images, vms_from_images);

/// The portal's scripts upload with the session cookie and its CSRF token (the cookie is
/// HttpOnly, so they cannot send a bearer token); the cookie alone, or with a wrong
/// token, is refused.
async fn upload_with_portal_session(b: Backend) {
    let s = TestServer::start(b, fast_config()).await;
    let img = new_image(&s, "cookie", "1", "qcow2").await;
    let url = s.url(&format!("/v1/images/{}/file", img.uuid));
    let cookie = format!("passage_session={}", s.admin);
    let csrf = passage_app::backend::csrf_for(&s.admin);
    let put = |csrf: Option<String>| {
        let mut rb = s
            .http
            .put(&url)
            .header("cookie", &cookie)
            .body(qcow2_bytes());
        if let Some(c) = csrf {
            rb = rb.header("x-csrf-token", c);
        }
        rb.send()
    };
    assert_eq!(put(None).await.unwrap().status(), 401);
    let wrong = passage_app::backend::csrf_for("another-session");
    assert_eq!(put(Some(wrong)).await.unwrap().status(), 401);
    // Another site's page cannot learn the token: without it, nothing changed.
    let still: Image = s.get(&format!("/v1/images/{}", img.uuid)).await.ok(200);
    assert_eq!(still.state, ImageState::Unactivated);
    let r = put(Some(csrf)).await.unwrap();
    assert_eq!(r.status(), 200);
    let up: Image = r.json().await.unwrap();
    assert_eq!(up.state, ImageState::Active);
    // The audit log names who did it.
    let log: serde_json::Value = s.get("/v1/audit?limit=100").await.ok(200);
    let entry = log
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["method"] == "PUT" && e["status"] == 200)
        .cloned()
        .unwrap_or_default();
    assert_eq!(entry["actor_login"], "admin", "{log}");
}
crate::both!(upload_with_portal_session, upload_with_portal_session);

/// A node's progress on its image download shows on the job step waiting for it; no
/// node reports on another's task.
async fn fetch_progress_on_the_job(b: Backend) {
    use passage_model::api::{Job, JobState, Progress, StepState, Vm};
    use passage_model::protocol::{Task, TaskEnvelope, TaskResult};
    let s = TestServer::start(b, fast_config()).await;
    let (_, cred, _) = s.manual_node(1).await;
    let (_, other_cred, _) = s.manual_node(0).await;
    s.h100_catalog(1).await;
    let vm: Vm = s
        .post(
            "/v1/vms",
            &json!({"alias": "p", "package": "gpu-1x", "image": "test-image"}),
        )
        .await
        .ok(202);
    let job = vm.job_uuid.unwrap();
    let node = s.client(Some(&cred));
    let mut fetched = false;
    let mut done = false;
    for _ in 0..20 {
        let tasks: Vec<TaskEnvelope> = node.get("/agent/v1/tasks?wait=5").await.ok(200);
        for t in tasks {
            let path = format!("/agent/v1/tasks/{}", t.id);
            if let Task::FetchImage { disk, .. } = &t.task {
                assert_eq!(disk.size_gib, 10, "the package's disk");
                assert_eq!(disk.image.size, test_image_bytes().len() as u64);
                s.client(Some(&other_cred))
                    .post::<()>(&format!("{path}/progress"), &json!({"done": 1, "total": 2}))
                    .await
                    .fails(404, ErrorCode::ResourceNotFound);
                node.post::<()>(&format!("{path}/progress"), &json!({"done": 3, "total": 2}))
                    .await
                    .err(400);
                node.post::<()>(
                    &format!("{path}/progress"),
                    &json!({"done": 100, "total": 1000}),
                )
                .await
                .ok(204);
                let j: Job = s.get(&format!("/v1/jobs/{job}")).await.ok(200);
                let step = j.steps.iter().find(|st| st.name == "fetch_image").unwrap();
                assert_eq!(step.state, StepState::Running);
                assert_eq!(
                    step.progress,
                    Some(Progress {
                        done: 100,
                        total: 1000
                    })
                );
                fetched = true;
            }
            let _: () = node
                .post(&format!("{path}/result"), &TaskResult::success())
                .await
                .ok(204);
        }
        let j: Job = s.get(&format!("/v1/jobs/{job}")).await.ok(200);
        if j.state == JobState::Succeeded {
            done = true;
            break;
        }
    }
    assert!(fetched && done);
}
crate::both!(fetch_progress_on_the_job, fetch_progress_on_the_job);

/// IMGAPI's `requirements.bootrom`: set on creation, changed by a PATCH (which sets the
/// requirements as a whole), and nothing but `uefi` or `bios` taken.
async fn bootrom_requirement(b: Backend) {
    use passage_model::images::Bootrom;
    let s = TestServer::start(b, fast_config()).await;
    let img: Image = s
        .post(
            "/v1/images",
            &json!({"name": "fw", "version": "1", "os": "linux", "type": "raw",
                    "requirements": {"bootrom": "uefi", "min_disk_gib": 3}}),
        )
        .await
        .ok(201);
    assert_eq!(img.requirements.bootrom, Some(Bootrom::Uefi));
    let raw: serde_json::Value = s.get(&format!("/v1/images/{}", img.uuid)).await.ok(200);
    assert_eq!(raw["requirements"]["bootrom"], "uefi", "{raw}");
    assert_eq!(raw["requirements"]["min_disk_gib"], 3, "{raw}");
    let p: Image = s
        .patch(
            &format!("/v1/images/{}", img.uuid),
            &json!({"requirements": {"bootrom": "bios", "min_disk_gib": 3}}),
        )
        .await
        .ok(200);
    assert_eq!(p.requirements.bootrom, Some(Bootrom::Bios));
    assert_eq!(p.requirements.min_disk_gib, Some(3));
    // A PATCH without `requirements` leaves them; one with them replaces them all.
    let p: Image = s
        .patch(
            &format!("/v1/images/{}", img.uuid),
            &json!({"description": "firmware"}),
        )
        .await
        .ok(200);
    assert_eq!(p.requirements.bootrom, Some(Bootrom::Bios));
    let p: Image = s
        .patch(
            &format!("/v1/images/{}", img.uuid),
            &json!({"requirements": {"min_disk_gib": 3}}),
        )
        .await
        .ok(200);
    assert_eq!(p.requirements.bootrom, None);
    let listed: Vec<serde_json::Value> = s.get("/v1/images?name=fw").await.ok(200);
    assert!(
        listed[0]["requirements"].get("bootrom").is_none(),
        "{listed:?}"
    );
    // Anything else: 400 naming the field, on creation and on a PATCH.
    for bad in [json!("efi"), json!("UEFI"), json!(1), json!({})] {
        s.post::<Image>(
            "/v1/images",
            &json!({"name": "fw", "version": "2", "os": "linux", "type": "raw",
                    "requirements": {"bootrom": bad}}),
        )
        .await
        .invalid("requirements.bootrom");
        s.patch::<Image>(
            &format!("/v1/images/{}", img.uuid),
            &json!({"requirements": {"bootrom": bad}}),
        )
        .await
        .invalid("requirements.bootrom");
    }
    let still: Image = s.get(&format!("/v1/images/{}", img.uuid)).await.ok(200);
    assert_eq!(still.requirements.bootrom, None);
    // `null` is the default, as absent.
    let p: Image = s
        .patch(
            &format!("/v1/images/{}", img.uuid),
            &json!({"requirements": {"bootrom": null}}),
        )
        .await
        .ok(200);
    assert_eq!(p.requirements.bootrom, None);
}
crate::both!(bootrom_requirement, bootrom_requirement);

/// Answers every task `node` is given with success until `job` ends; the specs of the VMs
/// it was asked to start.
async fn start_specs(
    s: &TestServer,
    node: &crate::common::Client,
    job: passage_model::JobId,
) -> Vec<passage_model::protocol::VmSpec> {
    use passage_model::api::{Job, JobState};
    use passage_model::protocol::{Task, TaskEnvelope, TaskResult};
    let mut specs = Vec::new();
    for _ in 0..30 {
        let tasks: Vec<TaskEnvelope> = node.get("/agent/v1/tasks?wait=2").await.ok(200);
        for t in tasks {
            if let Task::StartVm { vm } | Task::BootVm { vm, .. } = &t.task {
                specs.push(vm.clone());
            }
            let _: () = node
                .post(
                    &format!("/agent/v1/tasks/{}/result", t.id),
                    &TaskResult::success(),
                )
                .await
                .ok(204);
        }
        let j: Job = s.get(&format!("/v1/jobs/{job}")).await.ok(200);
        if j.state != JobState::Queued && j.state != JobState::Running {
            assert_eq!(j.state, JobState::Succeeded, "{j:?}");
            return specs;
        }
    }
    panic!("job {job} did not end");
}

/// The node starts each VM with its image's firmware, or without one the default for a VM
/// with devices (UEFI); a start after a stop boots the same.
async fn bootrom_reaches_the_node(b: Backend) {
    use passage_model::api::Vm;
    use passage_model::images::Bootrom;
    let s = TestServer::start(b, fast_config()).await;
    let (_, cred, _) = s.manual_node(2).await;
    let node = s.client(Some(&cred));
    s.h100_catalog(1).await;
    let bios: Image = s
        .post(
            "/v1/images",
            &json!({"name": "old-fw", "version": "1", "os": "linux", "type": "raw",
                    "public": true, "requirements": {"bootrom": "bios"}}),
        )
        .await
        .ok(201);
    upload(&s, &bios, vec![0x11u8; 4096]).await;
    let mut want = Vec::new();
    for (alias, image, bootrom) in [
        ("legacy", "old-fw", Bootrom::Bios),
        ("modern", "test-image", Bootrom::Uefi),
    ] {
        let vm: Vm = s
            .post(
                "/v1/vms",
                &json!({"alias": alias, "package": "gpu-1x", "image": image}),
            )
            .await
            .ok(202);
        let specs = start_specs(&s, &node, vm.job_uuid.unwrap()).await;
        assert_eq!(specs.len(), 1, "{specs:?}");
        assert_eq!(specs[0].uuid, vm.uuid);
        assert_eq!(specs[0].bootrom, Some(bootrom), "{alias}");
        want.push((vm, bootrom));
    }
    for (vm, bootrom) in want {
        let stopped: Vm = s
            .as_admin()
            .post_empty(&format!("/v1/vms/{}/stop", vm.uuid))
            .await
            .ok(202);
        start_specs(&s, &node, stopped.job_uuid.unwrap()).await;
        let started: Vm = s
            .as_admin()
            .post_empty(&format!("/v1/vms/{}/start", vm.uuid))
            .await
            .ok(202);
        let specs = start_specs(&s, &node, started.job_uuid.unwrap()).await;
        assert_eq!(specs.len(), 1, "{specs:?}");
        assert_eq!(specs[0].bootrom, Some(bootrom), "{}", vm.alias);
    }
}
crate::both!(bootrom_reaches_the_node, bootrom_reaches_the_node);
