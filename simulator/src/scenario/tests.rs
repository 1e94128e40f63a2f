use super::*;
use engine::PrefillPolicy;

/// `toml_text` over a ten-request synthetic workload, resolved.
pub(crate) fn resolve(toml_text: &str) -> Result<Settings, ScenarioError> {
    let base = r#"
        [workload.synthetic]
        requests = 10
        arrival = { kind = "poisson", rate_rps = 1.0 }
        input = { kind = "constant", tokens = 100 }
        output = { kind = "constant", tokens = 10 }
    "#;
    let s: Scenario = toml::from_str(&format!("{toml_text}\n{base}")).expect("parses");
    s.resolve()
}

#[test]
fn a_scenario_without_pools_runs_a_fixed_colocated_fleet() {
    let s = resolve("").expect("valid");
    assert_eq!(s.routers[0].pools, None);
    assert_eq!(s.sim_config(&s.routers[0]).pd, None);
}

#[test]
fn pool_runs_multiply_the_routers_and_inherit_the_section() {
    let s = resolve(
        r#"
        routers = ["round-robin", "least-outstanding"]
        [pools]
        gpu_budget = 12
        startup_s = 30
        runs = [ { label = "colo" }, { label = "slo", mode = "pd", prefill_instances = 2, decode_instances = 4, autoscaler = "slo-load" } ]
        "#,
    )
    .expect("valid");
    let labels: Vec<String> = s.routers.iter().map(RunSpec::label).collect();
    assert_eq!(labels, ["round-robin/colo", "round-robin/slo", "least-outstanding/colo", "least-outstanding/slo"]);
    let pd = s.routers[1].pools.as_ref().and_then(|p| p.pd).expect("a pd run");
    assert_eq!((pd.prefill, pd.decode, pd.gpu_budget, pd.startup), (2, 4, 12, Dur::from_millis(30_000)));
    assert_eq!(pd.autoscaler.name(), "slo-load");
    assert_eq!(s.routers[0].pools.as_ref().map(|p| p.pd), Some(None), "colo has a label and no pools");
}

#[test]
fn drafters_come_from_the_fleet_section_and_run_variants() {
    let s = resolve(
        r#"
        routers = ["round-robin", "round-robin@nospec", "round-robin@eagle3", "round-robin@dspark+l1"]
        [fleet]
        spec = "dflash"
        "#,
    )
    .expect("valid");
    let drafters: Vec<Option<&str>> = s.routers.iter().map(|r| s.sim_config(r).drafter.map(|d| d.name)).collect();
    assert_eq!(drafters, [Some("dflash"), None, Some("eagle3"), Some("dspark")]);
    assert_eq!(resolve("[fleet]\nspec = \"none\"").expect("valid").drafter, None);
    assert_eq!(resolve("").expect("valid").drafter, None, "no speculation by default");
}

#[test]
fn bad_drafters_name_the_valid_ones() {
    let err = |t: &str| resolve(t).expect_err("invalid").to_string();
    assert_eq!(err("[fleet]\nspec = \"medusa\""), "unknown drafter `medusa` (valid: none, eagle3, dflash, dspark)");
    assert_eq!(
        err("routers = [\"round-robin@eagle3+dspark\"]"),
        "invalid setting `routers`: `round-robin@eagle3+dspark` names two drafters"
    );
    assert_eq!(
        err("routers = [\"round-robin@medusa\"]"),
        "invalid setting `routers`: unknown variant `medusa` in `round-robin@medusa` \
         (valid: l1, l2, l3, fcfs, fair, hw, nohw, nospec, eagle3, dflash, dspark, or bN for a step budget of N tokens)"
    );
}

#[test]
fn a_run_variant_sets_its_step_budget() {
    let runs = resolve("routers = [\"round-robin\", \"round-robin@b2048\", \"round-robin@l1+b512+fair\"]\n[fleet]\nmax_batch_tokens = 4096")
        .expect("valid")
        .routers;
    let budgets: Vec<u32> = runs.iter().map(|r| r.max_batch_tokens).collect();
    assert_eq!(budgets, [4096, 2048, 512]);
    assert!(matches!(runs[2].prefill, PrefillPolicy::Fair(_)));
    assert_eq!(runs[1].label(), "round-robin@b2048");
    let err = |t: &str| resolve(t).expect_err("invalid").to_string();
    assert_eq!(
        err("routers = [\"round-robin@b0\"]"),
        "invalid setting `routers`: `round-robin@b0`: a step budget is at least 1 token"
    );
    assert_eq!(
        err("routers = [\"round-robin@b512+b1024\"]"),
        "invalid setting `routers`: `round-robin@b512+b1024` names two step budgets"
    );
    assert!(err("routers = [\"round-robin@bx\"]").contains("unknown variant `bx`"));
}

#[test]
fn offload_chunks_are_whole_blocks_dividing_a_page() {
    let chunk = |t: &str| resolve(&format!("[kv]\ntiers = \"l1,l2,l3\"\n{t}")).map(|s| s.instance.offload_chunk_blocks);
    assert_eq!(chunk("").expect("valid"), 1, "single blocks by default");
    assert_eq!(chunk("offload_chunk_tokens = 256").expect("valid"), 16);
    assert_eq!(chunk("offload_chunk_tokens = 512").expect("valid"), 32);
    let valid = "(valid: 16, 32, 64, 128, 256, 512)";
    for bad in ["100", "48", "1024", "0"] {
        let err = chunk(&format!("offload_chunk_tokens = {bad}")).expect_err("invalid").to_string();
        assert_eq!(
            err,
            format!(
                "invalid setting `kv.offload_chunk_tokens`: {bad} tokens is not a whole number of 16-token blocks \
                 dividing a page of 32 {valid}"
            )
        );
    }
}

#[test]
fn bad_pool_settings_name_their_key() {
    let err = |t: &str| resolve(t).expect_err("invalid").to_string();
    assert_eq!(
        err("[pools]\nmode = \"split\""),
        "invalid setting `pools.mode`: unknown mode `split` (valid: colocated, pd)"
    );
    assert_eq!(
        err("[pools]\nautoscaler = \"slo-load\""),
        "invalid setting `pools.autoscaler`: autoscaling needs mode = \"pd\" (--mode pd)"
    );
    assert_eq!(
        err("[pools]\nmode = \"pd\"\nautoscaler = \"magic\""),
        "unknown autoscaler `magic` (valid: none, fixed-xpyd, slo-load)"
    );
    assert_eq!(
        err("[pools]\nmode = \"pd\"\nxpyd = \"2x3\""),
        "invalid setting `pools.xpyd`: `2x3` is not X:Y with X, Y >= 1 (like 1:3)"
    );
    assert_eq!(
        err("[pools]\nmode = \"pd\"\nprefill_instances = 6\ndecode_instances = 6\ngpu_budget = 8"),
        "invalid setting `pools.gpu_budget`: 8 GPUs cannot hold the 12 starting instances of 1 GPUs"
    );
    assert!(toml::from_str::<Scenario>("[pools]\nprefil_instances = 2").is_err(), "unknown keys are refused");
    assert_eq!(
        err("[fleet]\ndispatch_ms = -1.0"),
        "invalid setting `fleet.dispatch_ms`: -1 is not a number of milliseconds >= 0"
    );
    assert_eq!(resolve("[fleet]\ndispatch_ms = 2.5").expect("valid").dispatch, Dur(2_500));
    assert_eq!(err("[fleet]\ninstances_per_gpu = 0"), "invalid setting `fleet.instances_per_gpu`: must be at least 1");
    assert_eq!(
        err("[fleet]\ntp = 2\ninstances_per_gpu = 2"),
        "invalid setting `fleet.instances_per_gpu`: engines share a GPU only as one-GPU instances of a colocated fleet"
    );
    assert_eq!(
        err("[fleet]\ngpu_share_efficiency = 1.5"),
        "invalid setting `fleet.gpu_share_efficiency`: 1.5 is not a share in (0, 1]"
    );
}

#[test]
fn fixed_xpyd_groups_default_to_the_starting_ratio() {
    let s = resolve("[pools]\nmode = \"pd\"\nprefill_instances = 2\ndecode_instances = 6\nautoscaler = \"fixed-xpyd\"")
        .expect("valid");
    let pd = s.routers[0].pools.as_ref().and_then(|p| p.pd).expect("pd");
    assert!(matches!(pd.autoscaler, AutoscalerConfig::FixedXpyd { x: 1, y: 3, .. }));
    assert_eq!(s.sim_config(&s.routers[0]).timeline, Some(Dur::from_millis(10_000)), "pd runs have a time series");
}

#[test]
fn an_engines_live_scheduling_is_checked_like_a_scenarios() {
    let check = |prefill: &str, high: Option<f64>, low: Option<f64>| {
        let section = SchedulerSection {
            prefill: Some(prefill.into()),
            kv_high_water: high,
            kv_low_water: low,
            ..SchedulerSection::default()
        };
        section.engine_scheduling().map_err(|e| e.to_string())
    };
    let (prefill, protection) = check("fair", Some(0.9), None).expect("valid");
    assert!(matches!(prefill, PrefillPolicy::Fair(_)));
    assert_eq!(protection.map(|p| (p.high_water, p.runaway_output_tokens)), Some((0.9, None)));
    assert!((protection.expect("on").low_water - 0.72).abs() < 1e-9, "80% of the high-water mark");
    assert_eq!(check("fcfs", None, None), Ok((PrefillPolicy::Fcfs, None)));
    assert_eq!(
        check("lifo", None, None).unwrap_err(),
        "invalid setting `scheduler.prefill`: unknown prefill scheduler `lifo` (valid: fcfs, fair)"
    );
    assert_eq!(
        check("fcfs", Some(1.5), None).unwrap_err(),
        "invalid setting `scheduler.kv_high_water`: 1.5 is not a share in (0, 1]"
    );
    assert_eq!(
        check("fcfs", Some(0.8), Some(0.9)).unwrap_err(),
        "invalid setting `scheduler.kv_low_water`: 0.9 is not a share in (0, kv_high_water = 0.8)"
    );
    assert_eq!(
        check("fcfs", None, Some(0.5)).unwrap_err(),
        "invalid setting `scheduler.kv_low_water`: a low-water mark needs kv_high_water"
    );
}

#[test]
fn a_routers_table_sets_its_parameters_and_labels_the_run() {
    let s = resolve(r#"routers = ["dynamo-kv", { name = "dynamo-kv@l1", overlap_score_weight = 2 }]"#).expect("valid");
    let weights: Vec<RouterConfig> = s.routers.iter().map(|r| s.sim_config(r).router).collect();
    let weight = |w| RouterConfig::from(policies::router::DynamoKvConfig { overlap_score_weight: w });
    assert_eq!(weights, [weight(1.0), weight(2.0)]);
    let labels: Vec<String> = s.routers.iter().map(RunSpec::label).collect();
    assert_eq!(labels, ["dynamo-kv", "dynamo-kv(overlap_score_weight=2)@l1"]);
}

#[test]
fn a_router_or_autoscaler_parameter_out_of_range_names_itself_and_its_range() {
    let e = resolve(r#"routers = [{ name = "llm-d", kv_weight = 20.0 }]"#).unwrap_err().to_string();
    assert_eq!(e, "invalid setting `routers.kv_weight`: llm-d's `kv_weight` is 20, outside its range [0, 16]");
    let e = resolve(r#"routers = [{ name = "llm-d", kv = "high" }]"#).unwrap_err().to_string();
    assert_eq!(e, "invalid setting `routers`: `kv` of `llm-d` is \"high\", not a number");
    let e = resolve(r#"routers = [{ overlap_score_weight = 1 }]"#).unwrap_err().to_string();
    assert!(e.contains("needs `name"), "{e}");
    let pd = "[pools]\nmode = \"pd\"\nautoscaler = \"slo-load\"\n";
    let s = resolve(&format!("{pd}autoscaler_params = {{ up_load = 0.9, up_hold = 2.5 }}")).expect("valid");
    let Some(AutoscalerConfig::SloLoad { knobs }) =
        s.routers[0].pools.as_ref().and_then(|p| p.pd).map(|p| p.autoscaler)
    else {
        panic!("slo-load")
    };
    assert_eq!((knobs.up_load, knobs.up_hold), (0.9, Dur::from_millis(2_500)));
    let e = resolve(&format!("{pd}autoscaler_params = {{ shrink_util = 0 }}")).unwrap_err().to_string();
    assert_eq!(
        e,
        "invalid setting `pools.autoscaler_params.shrink_util`: autoscaler's `shrink_util` is 0, outside its range (0, 1]"
    );
    let e = resolve("[scheduler]\nquota_growth = 0.5").unwrap_err().to_string();
    assert_eq!(e, "invalid setting `scheduler.quota_growth`: fair's `quota_growth` is 0.5, outside its range [1, 16]");
}
