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
