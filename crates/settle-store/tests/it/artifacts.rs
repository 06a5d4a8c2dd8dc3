//! The artifact stores Settle deletes from: a directory, memory, and a real S3 API (moto's
//! server, started by the test kit). Deleting what is gone is a success; a path never leaves
//! the store's root; a location Settle cannot open is refused with its reason.

use settle_store::{ArtifactStore, DIRECTORY_MARKER, ObjectArtifactStore, StoreCheck};
use settle_testkit::s3;
use std::sync::Arc;

async fn deletes_are_idempotent(store: &ObjectArtifactStore) {
    let paths = ["j1/i1/out.png", "j1/i1/deep/er/log.txt", "%2E%2E/i1/x", "j2/%2E/x"];
    for p in paths {
        store.put(p, p.as_bytes().to_vec()).await.unwrap();
        assert!(store.exists(p).await.unwrap(), "{p} written");
    }
    store.delete("j1/i1/out.png").await.unwrap();
    assert!(!store.exists("j1/i1/out.png").await.unwrap());
    assert!(store.exists("j1/i1/deep/er/log.txt").await.unwrap(), "only what was named");
    store.delete("j1/i1/out.png").await.unwrap_or_else(|e| panic!("a missing object is deleted: {e}"));
    store.delete("never/was/there").await.unwrap();
    let rest: Vec<String> = paths.iter().map(|p| (*p).to_owned()).chain(["gone/too/x".to_owned()]).collect();
    store.delete_all(&rest).await.unwrap();
    for p in paths {
        assert!(!store.exists(p).await.unwrap(), "{p} deleted");
    }
    for bad in ["", "a//b", "../x", "a/./b"] {
        assert!(store.put(bad, vec![1]).await.is_err(), "{bad:?} is no path");
        assert!(store.delete(bad).await.is_err(), "{bad:?} is no path");
    }
}

/// A key is one object; a worker that wrote under it as a directory (`frames/0001.png` under the
/// key `frames`) has that deleted with the key, and nothing that only begins with the same letters
/// (decision 0028 §6).
async fn a_key_used_as_a_directory_goes_whole(store: &ObjectArtifactStore) {
    let under = ["k/i/frames/0001.png", "k/i/frames/deep/0002.png"];
    let beside = ["k/i/frames2/x", "k/i/framesx", "k/j/frames/0001.png", "k/i/other"];
    for p in under.iter().chain(&beside) {
        store.put(p, vec![1]).await.unwrap();
    }
    store.delete_all(&["k/i/frames".to_owned(), "k/i/nothing".to_owned()]).await.unwrap();
    for p in under {
        assert!(!store.exists(p).await.unwrap(), "{p} deleted with its key");
    }
    for p in beside {
        assert!(store.exists(p).await.unwrap(), "{p} stays");
    }
    // A key that is both an object and a folder (possible in a bucket, not in a directory): both go.
    if !store.location().starts_with("file://") {
        store.put("k/i/both", vec![1]).await.unwrap();
        store.put("k/i/both/inner", vec![1]).await.unwrap();
        store.delete("k/i/both").await.unwrap();
        assert!(!store.exists("k/i/both").await.unwrap() && !store.exists("k/i/both/inner").await.unwrap());
    }
    store.delete_all(&beside.map(str::to_owned)).await.unwrap();
}

#[tokio::test]
async fn a_directory_store_deletes_files_and_treats_missing_ones_as_deleted() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("artifacts");
    let store = ObjectArtifactStore::open(&format!("file://{}", root.display())).unwrap();
    deletes_are_idempotent(&store).await;
    // A folder under a key goes whole, empty folders and symlinks in it too (a link is removed,
    // what it points to is not followed).
    std::fs::create_dir_all(root.join("k/i/frames/empty/er")).unwrap();
    std::fs::write(root.join("k/i/frames/0001.png"), b"x").unwrap();
    std::fs::create_dir_all(dir.path().join("outside")).unwrap();
    std::fs::write(dir.path().join("outside/keep"), b"x").unwrap();
    std::os::unix::fs::symlink(dir.path().join("outside"), root.join("k/i/frames/link")).unwrap();
    store.delete("k/i/frames").await.unwrap();
    assert!(!root.join("k/i/frames").exists());
    assert!(dir.path().join("outside/keep").exists(), "a link's target is not followed");
    a_key_used_as_a_directory_goes_whole(&store).await;
    // The same files a worker writes with plain file I/O at root/path, `%2E` as written.
    std::fs::create_dir_all(root.join("%2E/i")).unwrap();
    std::fs::write(root.join("%2E/i/k"), b"x").unwrap();
    assert!(store.exists("%2E/i/k").await.unwrap());
    store.delete("%2E/i/k").await.unwrap();
    assert!(!root.join("%2E/i/k").exists());
    // A plain path is a directory too, created if missing.
    let plain = dir.path().join("plain/dir");
    let store = ObjectArtifactStore::open(plain.to_str().unwrap()).unwrap();
    assert!(plain.is_dir());
    assert_eq!(store.location(), format!("file://{}", plain.canonicalize().unwrap().display()));
}

#[tokio::test]
async fn a_memory_store_behaves_like_the_others() {
    let store = ObjectArtifactStore::open("memory://").unwrap();
    deletes_are_idempotent(&store).await;
    a_key_used_as_a_directory_goes_whole(&store).await;
}

#[tokio::test]
async fn an_s3_store_deletes_under_its_prefix_and_in_bulk() {
    let bucket = s3::fresh_bucket();
    let store = ObjectArtifactStore::open_with(&bucket.url("renders/eu"), bucket.settings()).unwrap();
    let endpoint = format!("?endpoint={}", bucket.endpoint);
    assert_eq!(store.location(), format!("s3://{}/renders/eu{endpoint}", bucket.name), "the endpoint is part of it");
    deletes_are_idempotent(&store).await;
    a_key_used_as_a_directory_goes_whole(&store).await;
    // The objects are at prefix/path in the bucket: seen through a store with no prefix.
    let whole = ObjectArtifactStore::open_with(&bucket.url(""), bucket.settings()).unwrap();
    store.put("j/i/k", b"x".to_vec()).await.unwrap();
    assert!(whole.exists("renders/eu/j/i/k").await.unwrap());
    assert!(!whole.exists("j/i/k").await.unwrap());
    // More keys than one bulk delete request carries (1,000).
    let keys: Vec<String> = (0..1_203).map(|i| format!("big/i{i}/out")).collect();
    for k in keys.iter().step_by(100) {
        store.put(k, vec![0]).await.unwrap();
    }
    store.put("big/i1202/out", vec![0]).await.unwrap();
    store.delete_all(&keys).await.unwrap();
    for k in keys.iter().step_by(100).chain([&"big/i1202/out".to_owned()]) {
        assert!(!store.exists(k).await.unwrap(), "{k} deleted");
    }
    assert!(store.exists("j/i/k").await.unwrap(), "what was not named stays");
}

#[tokio::test]
async fn an_unreachable_s3_store_fails_the_delete_with_its_reason() {
    let bucket = s3::fresh_bucket();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let dead = format!("http://127.0.0.1:{port}");
    let store = ObjectArtifactStore::open_with(&bucket.url("p"), bucket.settings_via(&dead)).unwrap();
    let err = store.delete("j/i/k").await.unwrap_err();
    assert!(err.contains(&format!("s3://{}/p", bucket.name)), "{err}");
    assert!(matches!(store.check().await, Err(StoreCheck::Unreachable(_))));
    // A misnamed bucket: its "not found" is no deleted artifact.
    let missing = ObjectArtifactStore::open_with("s3://no-such-bucket-here/p", bucket.settings()).unwrap();
    let err = missing.delete_all(&["j/i/k".to_owned()]).await.unwrap_err();
    assert!(err.contains("no-such-bucket-here"), "{err}");
    let check = missing.check().await;
    assert!(matches!(check, Err(StoreCheck::Misconfigured(ref m)) if m.contains("no-such-bucket-here")), "{check:?}");
    let good = ObjectArtifactStore::open_with(&bucket.url("p"), bucket.settings()).unwrap();
    good.check().await.unwrap();
}

#[test]
fn locations_settle_cannot_open_are_refused_with_the_reason() {
    for (bad, reason) in [
        ("ftp://host/dir", "unknown scheme ftp://"),
        ("gs://bucket/p", "unknown scheme gs://"),
        ("s3://", "name the bucket"),
        ("s3:///prefix", "name the bucket"),
        ("s3://bucket/a//b", "prefix"),
        ("file://relative/dir", "absolute path"),
        ("memory://something", "takes no path"),
        ("s3://Render_Outputs/p", "bucket name"),
        ("s3://key:hunter2@bucket/p", "bucket name"),
        ("s3://ab/p", "bucket name"),
        ("s3://-bucket/p", "bucket name"),
    ] {
        let err = ObjectArtifactStore::open(bad).unwrap_err().to_string();
        let shown = bad.replace("key:hunter2@", "***@");
        assert!(err.contains(reason) && err.contains(&shown) && !err.contains("hunter2"), "{bad}: {err}");
    }
    let with_userinfo = [("aws_endpoint", "http://user:secret@127.0.0.1:9000")];
    let err = ObjectArtifactStore::open_with("s3://bucket/p", with_userinfo).unwrap_err().to_string();
    assert!(err.contains("carries credentials") && !err.contains("secret@"), "{err}");
    let file = tempfile::NamedTempFile::new().unwrap();
    let err = ObjectArtifactStore::open(file.path().to_str().unwrap()).unwrap_err().to_string();
    assert!(err.contains("not a directory"), "a file is no directory: {err}");
}

#[tokio::test]
async fn a_directory_without_its_marker_is_no_store_deletes_can_trust() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("artifacts");
    let store = ObjectArtifactStore::local(&root).unwrap();
    assert!(root.join(DIRECTORY_MARKER).exists(), "marked when opened");
    store.check().await.unwrap();
    store.put("j/i/k", b"x".to_vec()).await.unwrap();
    // The volume is unmounted (or the folder replaced): what is there now is not the store.
    std::fs::remove_file(root.join(DIRECTORY_MARKER)).unwrap();
    let err = store.delete("j/i/k").await.unwrap_err();
    assert!(err.contains("is the volume mounted"), "{err}");
    assert!(root.join("j/i/k").exists(), "nothing deleted");
    assert!(matches!(store.check().await, Err(StoreCheck::Misconfigured(_))));
    // Nor is it opened again: an existing directory must carry the marker (an empty mount point
    // does not). Marked by hand, it is the store again.
    let err = ObjectArtifactStore::local(&root).unwrap_err().to_string();
    assert!(err.contains("not marked as Settle's artifact store") && err.contains("touch"), "{err}");
    std::fs::write(root.join(DIRECTORY_MARKER), b"").unwrap();
    ObjectArtifactStore::local(&root).unwrap().delete("j/i/k").await.unwrap();
    assert!(!root.join("j/i/k").exists());
    // A directory that exists without the marker (a mount point) is refused at once.
    let mount = dir.path().join("mnt");
    std::fs::create_dir(&mount).unwrap();
    assert!(ObjectArtifactStore::open(mount.to_str().unwrap()).is_err());
    assert!(!mount.join(DIRECTORY_MARKER).exists(), "and left unmarked");
}

#[tokio::test]
async fn a_store_that_never_answers_fails_the_delete_in_bounded_time_then_fails_fast() {
    // Accepts connections and never answers a byte.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("http://{}", silent.local_addr().unwrap());
    let keep = std::thread::spawn(move || {
        let held: Vec<_> = silent.incoming().take(16).collect();
        std::thread::sleep(std::time::Duration::from_secs(60));
        drop(held);
    });
    let bucket = s3::fresh_bucket();
    let store = ObjectArtifactStore::open_with(&bucket.url("p"), bucket.settings_via(&endpoint)).unwrap();
    let started = std::time::Instant::now();
    let err = store.delete_all(&["j/i/k".to_owned()]).await.unwrap_err();
    assert!(started.elapsed() < std::time::Duration::from_secs(60), "held for {:?}", started.elapsed());
    assert!(err.contains(&format!("s3://{}/p", bucket.name)), "{err}");
    // The next teardown in the same pass does not wait for the store again.
    let again = std::time::Instant::now();
    let err = store.delete("j/i/k2").await.unwrap_err();
    assert!(err.contains("did not answer"), "{err}");
    assert!(again.elapsed() < std::time::Duration::from_secs(1), "{:?}", again.elapsed());
    drop(keep);
}

#[tokio::test]
async fn a_teardown_deletes_artifacts_in_the_store_they_were_registered_in() {
    use crate::kit::{acc, claim_req, fail_sig, jid, new_job};
    use settle_core::Credits;
    use settle_core::ids::*;
    use settle_core::job::JobState;
    use settle_store::*;
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("settle.db").display());
    let open = |artifacts: &str| {
        let store = ObjectArtifactStore::local(dir.path().join(artifacts)).unwrap();
        let options = StoreOptions { artifacts: Some(Arc::new(store)), ..StoreOptions::default() };
        SqlStore::open(&url, options)
    };
    let first = open("a").await.unwrap();
    let a = acc("a");
    first
        .create_account(
            NewAccount { id: a.clone(), overdraft_limit: Credits::ZERO, max_running: None },
            settle_store::SYSTEM_ACTOR,
        )
        .await
        .unwrap();
    let grant = NewGrant {
        id: RefId::parse("g").unwrap(),
        amount: Credits::new(20),
        reason: None,
        expires_at: None,
        priority: None,
    };
    first.grant(&a, grant, settle_store::SYSTEM_ACTOR).await.unwrap();
    let mut tokens = Vec::new();
    for j in ["j1", "j2"] {
        first.create_job(new_job(j, &a, 10)).await.unwrap();
        let token = first.claim(claim_req("w", 1)).await.unwrap().remove(0).lease_token;
        let artifact = NewArtifact { key: ArtifactKey::parse("out.png").unwrap() };
        first.register_artifact(&jid(j), &ItemId::main(), &token, artifact).await.unwrap();
        let written = dir.path().join("a").join(j).join("main").join("out.png");
        std::fs::create_dir_all(written.parent().unwrap()).unwrap();
        std::fs::write(&written, b"x").unwrap();
        first.cancel(&jid(j), None).await.unwrap();
        tokens.push(token);
    }
    drop(first);

    // The teardowns run in a process configured with another directory (another working dir):
    // each artifact is deleted where it was registered, not looked for here and "found gone".
    let elsewhere = open("b").await.unwrap();
    let j1 = elsewhere.fail(&jid("j1"), fail_sig(&tokens[0], "CANCELLED")).await.unwrap().value;
    assert_eq!(j1.state, JobState::Cancelled);
    assert!(!dir.path().join("a/j1/main/out.png").exists(), "deleted where it was registered");
    // The store it was registered in is gone from here (unmounted): the teardown waits for it.
    std::fs::remove_file(dir.path().join("a").join(DIRECTORY_MARKER)).unwrap();
    let elsewhere = open("c").await.unwrap();
    let j2 = elsewhere.fail(&jid("j2"), fail_sig(&tokens[1], "CANCELLED")).await.unwrap().value;
    assert_eq!(j2.state, JobState::Cancelling, "not ended with its artifact left behind");
    assert!(elsewhere.resume_teardowns(10).await.unwrap().is_empty());
    assert!(dir.path().join("a/j2/main/out.png").exists());
    std::fs::write(dir.path().join("a").join(DIRECTORY_MARKER), b"").unwrap();
    // The sweeper waits for the retry time (a second after the first failure); a cancel sent
    // again tries at once.
    assert!(elsewhere.resume_teardowns(10).await.unwrap().is_empty());
    assert!(matches!(elsewhere.cancel(&jid("j2"), None).await.unwrap(), CancelOutcome::Cancelled(_)));
    assert!(!dir.path().join("a/j2/main/out.png").exists());
    assert!(!dir.path().join("b").join("j2").exists() && !dir.path().join("c").join("j2").exists());
}
