//! The simulator's own promises (docs/decisions/0025): a seed replays exactly — the same trace
//! hash every time — two seeds explore different runs, and a range of seeds passes the auditor.

fn run(seed: u64, steps: u32) -> settle_dst::Report {
    let dir = tempfile::tempdir().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(settle_dst::run(seed, steps, dir.path())).unwrap()
}

#[test]
fn one_seed_twice_is_one_run_and_two_seeds_are_two() {
    let (a, b, c) = (run(7, 150), run(7, 150), run(8, 150));
    assert_eq!(a.trace_hash, b.trace_hash, "seed 7 ran two ways");
    assert_eq!((a.crashes, a.jobs), (b.crashes, b.jobs));
    assert_ne!(a.trace_hash, c.trace_hash, "seeds 7 and 8 ran alike");
    assert!(a.violation.is_none(), "{:?}", a.violation);
}

#[test]
fn a_range_of_seeds_passes_the_auditor() {
    for seed in 100..112 {
        let r = run(seed, 150);
        assert!(r.violation.is_none(), "seed {seed}: {:?} (replay: settle sim --seed {seed} --steps 150)", r.violation);
        assert!(r.jobs > 0);
    }
}
