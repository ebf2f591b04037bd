#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The built helper as the agent runs it: exit codes and the one line on stderr, on a
//! machine without a GPU (and, where the CUDA driver is installed, without touching a
//! GPU: the addresses used here name none).

use std::process::{Command, Output};

fn helper(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_passage-gpu-zero"))
        .args(args)
        .output()
        .unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// No device has this address: domain ffff, bus ff, device 1f, function 7.
const NOWHERE: &str = "ffff:ff:1f.7";

#[test]
fn without_the_driver_library_it_exits_3() {
    let o = helper(&[
        "--bdf",
        NOWHERE,
        "--cuda-library",
        "/nonexistent/libcuda.so.1",
    ]);
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    assert_eq!(
        stderr(&o),
        "CUDA driver (/nonexistent/libcuda.so.1) not found; GPU memory not zeroed\n"
    );
    assert!(o.stdout.is_empty());
}

#[test]
fn with_the_default_library() {
    // Here (no NVIDIA driver) exit 3 with the documented line; on a host with the driver,
    // a failure to find the device.
    let o = helper(&["--bdf", NOWHERE]);
    match o.status.code() {
        Some(3) => assert_eq!(
            stderr(&o),
            "CUDA driver (libcuda.so.1) not found; GPU memory not zeroed\n"
        ),
        Some(1) => assert_eq!(stderr(&o).lines().count(), 1, "{}", stderr(&o)),
        other => panic!("exit {other:?}: {}", stderr(&o)),
    }
}

#[test]
fn a_broken_driver_library_is_a_failure_not_a_skip() {
    let dir = tempfile::tempdir().unwrap();
    // Not a shared object at all.
    let junk = dir.path().join("libcuda.so.1");
    std::fs::write(&junk, "not an ELF file\n").unwrap();
    let o = helper(&["--bdf", NOWHERE, "--cuda-library", junk.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).starts_with("cannot load "), "{}", stderr(&o));
    assert_eq!(stderr(&o).lines().count(), 1);
    // A real library without the driver's functions.
    let o = helper(&["--bdf", NOWHERE, "--cuda-library", "libc.so.6"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert_eq!(
        stderr(&o),
        "libc.so.6 has no cuInit: not the CUDA driver library, or one too old\n"
    );
}

#[test]
fn bad_arguments_exit_2_with_one_line() {
    for args in [
        &[][..],
        &["--bdf", "3b:00.0"],
        &["--bdf", "0000:3b:00.0", "--chunk-mib", "0"],
    ] {
        let o = helper(args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
        assert_eq!(stderr(&o).lines().count(), 1, "{args:?}: {}", stderr(&o));
        assert!(!stderr(&o).starts_with("error:"), "{}", stderr(&o));
    }
    let o = helper(&["--bdf", "3b:00.0"]);
    assert!(
        stderr(&o).contains("expected a PCI address like 0000:3b:00.0"),
        "{}",
        stderr(&o)
    );
    let o = helper(&["--help"]);
    assert_eq!(o.status.code(), Some(0));
    let help = String::from_utf8_lossy(&o.stdout);
    assert!(
        help.contains("--bdf") && help.contains("Exit codes"),
        "{help}"
    );
    assert!(
        !help.contains("--cuda-library"),
        "a hidden test flag: {help}"
    );
}
