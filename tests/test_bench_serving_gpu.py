"""The GPU serving benchmark's pieces that need no GPU: its models are what they say, and a run
whose two sides built different model runners is stopped, not compared."""

from __future__ import annotations

import json
import lzma
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import bench_serving as bs


@pytest.mark.parametrize(("name", "low", "high"), [("1b", 0.9e9, 1.3e9), ("hybrid", 0.6e9, 1.3e9)])
def test_gpu_models_are_the_size_they_say(name: str, low: float, high: float) -> None:
    """Each config builds its transformers model (on the meta device: no memory, no weights)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    spec = bs.GPU_MODELS[name].spec
    config = getattr(transformers, spec.config_class)(**dict(spec.config))
    with torch.device("meta"):
        model = getattr(transformers, spec.model_class)(config)
    params = sum(p.numel() for p in model.parameters())
    assert low <= params <= high, f"{name}: {params / 1e9:.2f}B parameters"
    assert spec.torch_dtype == "bfloat16"


def test_the_users_configuration_is_compiled_with_vllms_runner() -> None:
    users = bs.GPU_MODELS["1b"]
    assert (users.eager, users.model_runner) == (False, "vllm")
    assert {(m.eager, m.model_runner) for m in bs.GPU_MODELS.values()} >= {(True, "vllm"), (False, "v1")}


def _facts(model: str, side: str, runner: str) -> bs.ServerFacts:
    return bs.ServerFacts(model, side, 1, 10.0, 0, None, "log", runner)


def test_both_sides_must_build_the_same_runner(tmp_path: Path) -> None:
    from conformance.serving import ServerError

    sess = bs.Session(("saturation",), {"1b": 8}, tmp_path, bs.SETUPS["cuda"])
    assert bs.runner_of("INFO [gpu_worker.py:378] Using V2 Model Runner") == "V2"
    assert bs.runner_of("INFO [gpu_worker.py:378] Using FLASH_ATTN backend") == "V1"
    bs.check_same_runner(sess, "1b", "V2")  # the first server: nothing to compare with
    sess.servers.append(_facts("1b", "native", "V2"))
    bs.check_same_runner(sess, "1b", "V2")
    bs.check_same_runner(sess, "hybrid", "V1")  # another model's servers do not count
    with pytest.raises(ServerError, match=r"1b: this server ran Model Runner V1, an earlier one \['V2'\]"):
        bs.check_same_runner(sess, "1b", "V1")


def test_a_gpu_report_names_its_setup_and_the_runner() -> None:
    doc = {"rounds": 3, "setup": bs.asdict(bs.SETUPS["cuda"]),
           "servers": [bs.asdict(_facts("1b", "native", "V2")), bs.asdict(_facts("1b", "kvcached", "V2"))]}
    assert "random dataset 1024 in / 256 out" in bs._method(doc) and "max-model-len 4096" in bs._method(doc)
    assert bs._server_line(doc, "1b").endswith("Model Runner (from each server's log): V2.")
    cpu = {"rounds": 5, "servers": []}  # saved before setups existed: a CPU run, its method text unchanged
    assert bs._method(cpu) == bs.METHOD.format(rounds=5, threads="vLLM's CPU thread defaults")
    now = {"rounds": 5, "setup": bs.asdict(bs.SETUPS["cpu"]), "servers": []}  # CPU runs from 12-05
    assert "seed 0, OMP_NUM_THREADS=1 in every server process (VLLM_CPU_OMP_THREADS_BIND=nobind)" in bs._method(now)
    assert "OMP_NUM_THREADS" not in bs._method(doc)  # on a GPU the threads are vLLM's choice


def _result(scale: float) -> dict[str, float]:
    return {m.key: scale * (100.0 if m.higher_is_better else 10.0) for m in bs.METRICS}


def test_a_gpu_run_renders_its_report_and_plot(tmp_path: Path) -> None:
    """The report of a run, from the saved document as `--render` reads it: method, verdicts, plot.
    Round 2's kvcached is 20% slower, so its spread crosses the targets (inconclusive), and the
    medians of rounds 1 and 3 (equal sides) meet them."""
    import json

    setup = bs.SETUPS["cuda"]
    sess = bs.Session(("saturation", "rate"), {"1b": 8}, tmp_path, setup)
    for rnd, slow in ((1, 1.0), (2, 1.2), (3, 1.0)):
        for phase in ("saturation", "rate"):
            config = bs.phase_config(phase, bs.Rates(4.0), 8, setup.saturation_concurrency)
            sess.runs.append(bs.PhaseRun("1b", "native", rnd, config, _result(1.0)))
            kvc = {k: v / slow if k.endswith("throughput") else v * slow for k, v in _result(1.0).items()}
            sess.runs.append(bs.PhaseRun("1b", "kvcached", rnd, config, kvc))
        sess.servers += [_facts("1b", "native", "V2"), _facts("1b", "kvcached", "V2")]
    sess.rates["1b"] = bs.Rates(4.0)
    meta = {"environment": {"command": "test"}, "rounds": 3, "setup": bs.asdict(setup), "load_before": 0.0,
            "load_after": 0.0, "elapsed_s": 1.0, "targets": setup.targets, "work_dir": str(tmp_path)}
    doc = json.loads(json.dumps(bs._jsonable(bs.report(sess, meta, [bs.GPU_MODELS["1b"]]))))
    by_metric = {c["metric"]: c for c in doc["comparisons"]["1b"]["saturation"]}
    assert by_metric["output_throughput"]["median_ratio"] == 1.0
    assert by_metric["output_throughput"]["verdict"] == "inconclusive"
    bs.plot(doc, tmp_path / "serving.png")
    assert (tmp_path / "serving.png").stat().st_size > 10_000
    text = bs.write_report(bs.build(doc), tmp_path, "serving").read_text()
    assert "serving.png" in text and "1b saturation output tok/s inconclusive" in text
    assert "Model Runner (from each server's log): V2." in text


def test_a_run_cut_short_renders_the_rounds_both_sides_finished(tmp_path: Path) -> None:
    """A lease that ends in round 3, after its native server: `--render` reports rounds 1-2 from
    serving.partial.json (as `main` saves it after every server), and says it was cut short."""
    import json

    setup = bs.SETUPS["cuda"]
    sess = bs.Session(("saturation", "rate"), {"1b": 8}, tmp_path, setup)
    for rnd, sides in ((1, ("native", "kvcached")), (2, ("kvcached", "native")), (3, ("native",))):
        for side in sides:
            for phase in ("saturation", "rate"):
                config = bs.phase_config(phase, bs.Rates(4.0), 8, setup.saturation_concurrency)
                sess.runs.append(bs.PhaseRun("1b", side, rnd, config, _result(1.0 if side == "native" else 0.95)))
            sess.servers.append(_facts("1b", side, "V2"))
    meta = {"environment": {"command": "test"}, "rounds": 5, "setup": bs.asdict(setup), "load_before": 0.0,
            "targets": setup.targets, "work_dir": str(tmp_path)}
    partial = {**meta, "aborted": True, "runs": [bs.asdict(r) for r in sess.runs],
               "servers": [bs.asdict(f) for f in sess.servers]}
    (tmp_path / "serving.partial.json").write_text(json.dumps(bs._jsonable(partial)))
    again, meta2, models = bs.from_partial(json.loads((tmp_path / "serving.partial.json").read_text()))
    assert [m.name for m in models] == ["1b"] and again.phases == ("saturation", "rate")
    doc = json.loads(json.dumps(bs._jsonable(bs.report(again, meta2, models))))
    throughput = next(c for c in doc["comparisons"]["1b"]["saturation"] if c["metric"] == "output_throughput")
    assert throughput["rounds"] == [1, 2] and throughput["median_ratio"] == pytest.approx(0.95)
    text = bs.write_report(bs.build(doc), tmp_path, "serving").read_text()
    assert "Cut short: 2 of the 5 planned rounds finished on both sides" in text
    with pytest.raises(SystemExit, match="no finished phase"):
        bs.from_partial({**partial, "runs": []})


def test_a_report_shows_kvcached_pool_counters_from_each_servers_shutdown_line() -> None:
    from kvcached.stats import PoolStats, parse_shutdown_lines, shutdown_line

    def pool(blocking: int) -> dict[str, object]:
        snap = PoolStats(*range(12), page_takes=100, reserve_hits=100 - blocking, blocking_maps=blocking)
        (parsed,) = parse_shutdown_lines(f"(EngineCore pid=1) INFO {shutdown_line(snap)}")
        return parsed

    servers = [bs.asdict(_facts("1b", "native", "V2"))]
    servers += [{**bs.asdict(_facts("1b", "kvcached", "V2")), "pool": pool(b)} for b in (0, 2, 4)]
    servers.append(bs.asdict(_facts("1b", "kvcached", "V2")))  # a server that logged no shutdown line
    line = bs._server_line({"servers": servers}, "1b")
    assert "kvcached's pool over each server's life, 3 servers (1 server(s) logged none)" in line
    assert "pages mapped on the scheduler's path 2 (0-4)" in line and "pages taken 100 (100-100)" in line
    assert bs._pool_line([bs.asdict(_facts("1b", "native", "V2"))]) == ""


GRAPH_TABLE = """(APIServer pid=1) INFO 12-04 13:02:48 [loggers.py:310] Engine 000: Avg prompt throughput: 1.0 tokens/s
**CUDAGraph Config Settings:**

- Mode: FULL_AND_PIECEWISE
- Capture sizes: [1, 2, 4]

**CUDAGraph Stats:**

| Unpadded Tokens | Padded Tokens | Num Paddings | Runtime Mode | Count |
|-----------------|---------------|--------------|--------------|-------|
| 3               | 4             | 1            | FULL         | 30    |
| 1024            | 1024          | 0            | NONE         | 2     |
"""


def test_graph_modes_are_summed_over_every_logged_table_and_reported_per_side() -> None:
    log = GRAPH_TABLE + "INFO other\n" + GRAPH_TABLE.replace("| 30 ", "| 8  ")
    assert bs.graph_modes(log) == {"FULL": 38, "NONE": 4}
    assert bs.graph_modes("INFO no table here\n| a | b |\n") == {}
    servers = [{**bs.asdict(_facts("1b", side, "V1")), "graph_modes": modes}
               for side, modes in (("native", {"FULL": 98, "NONE": 2}), ("kvcached", {"FULL": 40, "NONE": 60}))]
    line = bs._graph_line(servers)
    assert "native FULL 98.0%, NONE 2.0% of 100 steps; kvcached FULL 40.0%, NONE 60.0% of 100 steps" in line
    v2 = [{**bs.asdict(_facts("1b", "native", "V2")), "graph_modes": {}}]
    assert "logged no step" in bs._graph_line(v2)
    assert bs._graph_line([bs.asdict(_facts("1b", "native", "V2"))]) == ""  # a CPU run: not asked for


def _cut_short(tmp_path: Path, plan: dict[str, object]) -> dict[str, object]:
    """serving.partial.json of a lease that ended in round 2's native server, mid-phase:
    round 1 and round 2's kvcached finished, round 2's native ran its saturation phase only."""
    import json

    setup = bs.SETUPS["cuda"]
    sess = bs.Session(("saturation", "rate"), {"1b": 8}, tmp_path, setup)
    for rnd, side, phases in ((1, "native", 2), (1, "kvcached", 2), (2, "kvcached", 2), (2, "native", 1)):
        for phase in ("saturation", "rate")[:phases]:
            config = bs.phase_config(phase, bs.Rates(4.0), 8, setup.saturation_concurrency)
            sess.runs.append(bs.PhaseRun("1b", side, rnd, config, _result(1.0)))
        if phases == 2:
            sess.servers.append(bs.ServerFacts("1b", side, rnd, 10.0, 0, None, "log", "V2"))
    meta = {"environment": {"command": "test", "date": "d1"}, "rounds": 3, "setup": bs.asdict(setup), "plan": plan,
            "load_before": 0.0, "targets": setup.targets, "work_dir": str(tmp_path)}
    return json.loads(json.dumps(bs._jsonable({**meta, "aborted": True, "runs": [bs.asdict(r) for r in sess.runs],
                                                "servers": [bs.asdict(f) for f in sess.servers]})))


def test_a_run_cut_short_resumes_with_the_servers_it_lacks(tmp_path: Path) -> None:
    """`--resume` keeps the finished servers, runs again the one cut mid-phase, then the rest,
    in the planned order; another run's arguments are refused by name, and nothing runs."""
    plan = {"device": "cuda", "models": ["1b"], "phases": ["saturation", "rate"], "prompts": {"1b": 8}, "rounds": 3}
    models = [bs.GPU_MODELS["1b"]]
    sess, meta = bs.resume(_cut_short(tmp_path, plan), plan, tmp_path)
    assert [s for s in bs.planned_servers(models, 3) if s not in bs.finished(sess)] == [
        ("1b", 2, "native"), ("1b", 3, "native"), ("1b", 3, "kvcached")]
    assert len(sess.runs) == 6 and {r.round for r in sess.runs if r.side == "native"} == {1}  # the cut one's dropped
    assert sess.rates["1b"] == bs.Rates(bs.PhaseRun("1b", "native", 1, sess.runs[0].phase, _result(1.0))
                                        .metric("request_throughput"))
    with pytest.raises(SystemExit, match=r"--resume: not the run saved .*rounds: saved 3, asked 5"):
        bs.resume(_cut_short(tmp_path, plan), {**plan, "rounds": 5}, tmp_path)
    old = _cut_short(tmp_path, plan)
    del old["plan"]
    with pytest.raises(SystemExit, match="saved before runs recorded their plan"):
        bs.resume(old, plan, tmp_path)
    doc = {"rounds": 3, "elapsed_s": 5.0, "load_before": 0.0, "load_after": 0.0, "environment": meta["environment"],
           "resumed": [{"date": "d2"}], "setup": meta["setup"], "servers": [], "models": {}, "comparisons": {}}
    assert "Run in 2 parts (--resume, each on a fresh server set; parts began d1, d2" in bs.build(doc).body[0].blocks[1].text


def test_a_time_budget_starts_no_server_that_would_not_finish_in_it(tmp_path: Path) -> None:
    """`--time-budget` stops between servers by the longest time of the servers this part
    finished, or before it has any, of the saved ones; a server saved before servers had a time
    is no estimate, and a part's first server with no estimate starts."""
    plan = {"device": "cuda", "models": ["1b"], "phases": ["saturation", "rate"], "prompts": {"1b": 8}, "rounds": 3}
    doc = _cut_short(tmp_path, plan)
    assert all("wall_s" in f for f in doc["servers"])
    for f in doc["servers"]:
        del f["wall_s"]  # a run saved before ServerFacts had it
    sess, _ = bs.resume(doc, plan, tmp_path)
    bs.check_time(sess, 10.0, 9.0, ("1b", 2, "native"))  # no time known: it starts
    sess.servers[0].wall_s, sess.servers[1].wall_s = 120.0, 190.0
    bs.check_time(sess, 500.0, 310.0, ("1b", 2, "native"))
    bs.check_time(sess, None, 9999.0, ("1b", 2, "native"))
    with pytest.raises(bs.OutOfTime, match="189 s of --time-budget left, a server takes up to 190 s: "
                                           "stopped before 1b/2/native"):
        bs.check_time(sess, 500.0, 311.0, ("1b", 2, "native"))
    # This part's own servers, once it has any, are the estimate (the first saved one was cold).
    sess.servers.append(bs.ServerFacts("1b", "native", 2, 10.0, 0, None, "log", "V2", wall_s=130.0))
    bs.check_time(sess, 500.0, 370.0, ("1b", 3, "native"), started_with=3)
    with pytest.raises(bs.OutOfTime, match="129 s of --time-budget left, a server takes up to 130 s"):
        bs.check_time(sess, 500.0, 371.0, ("1b", 3, "native"), started_with=3)


def test_an_ablation_names_kvcached_knobs_checked_by_kvcacheds_own_parser() -> None:
    """`--kvcached-env` takes only kvcached's own knobs, with values its config accepts; a bad item
    stops the run before any server starts, naming it. The report calls such a run an ablation."""
    assert bs.kvcached_env(["KVCACHED_MAX_RESERVE_PAGES=64", "KVCACHED_MAX_CACHED_BLOCKS=-1"]) == (
        ("KVCACHED_MAX_RESERVE_PAGES", "64"), ("KVCACHED_MAX_CACHED_BLOCKS", "-1"))
    for bad, said in [("MAX_RESERVE_PAGES=64", "want KVCACHED_<knob>=VALUE"), ("KVCACHED_ENABLE=0", "want KVCACHED_"),
                      ("KVCACHED_RESERVE=64", "not a knob of kvcached's config: KVCACHED_RESERVE"),
                      ("KVCACHED_MAX_RESERVE_PAGES=-1", "KVCACHED_MAX_RESERVE_PAGES"),
                      ("KVCACHED_MIN_RESERVE_PAGES=9", "exceeds")]:
        with pytest.raises(SystemExit, match=said):
            bs.kvcached_env([bad])
    setup = bs.replace(bs.SETUPS["cuda"], kvcached_env=(("KVCACHED_MAX_RESERVE_PAGES", "64"),), step_times=True)
    doc = {"rounds": 1, "setup": bs.asdict(setup)}
    assert bs._setup(json.loads(json.dumps(doc))) == setup  # as --render reads it back
    text = bs._method(doc)
    assert "an ablation, not kvcached as users get it: its servers also had KVCACHED_MAX_RESERVE_PAGES=64" in text
    assert "A diagnostic run: the harness's step timer" in text
    assert "ablation" not in bs._method({"rounds": 1, "setup": bs.asdict(bs.SETUPS["cuda"])})


def test_step_times_go_to_the_phase_whose_client_ran_and_only_where_both_sides_have_them(tmp_path: Path) -> None:
    config = bs.PhaseConfig("saturation", float("inf"), 4, 8, 1)
    runs = [bs.PhaseRun("1b", "native", 1, config, {}), bs.PhaseRun("1b", "native", 1, bs.replace(config, name="rate"), {})]
    log = tmp_path / "native.steps.jsonl"
    # [wall time, schedule s, update s, requests, tokens]: 3 steps in the first window (one idle), 1 in the second
    rows = [[10.0, 0.001, 0.002, 4, 4], [11.0, 0.002, 0.002, 4, 4], [12.0, 0.0, 0.0, 0, 0], [12.5, 0.013, 0.0, 4, 4],
            [20.0, 0.005, 0.0, 2, 2], [30.0, 1.0, 1.0, 4, 4]]
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    bs.add_step_times(log, [(runs[0], 10.0, 13.0), (runs[1], 19.0, 21.0)])
    assert runs[0].result == {"sched_ms_p50": pytest.approx(4.0), "sched_ms_p95": pytest.approx(4.0), "sched_steps": 3,
                              "graph_replays_per_step": None,  # a log from before the replay count
                              "step_ms_p50": pytest.approx(1250.0), "requests_per_step": pytest.approx(4.0),
                              # 13 ms is over 3x the 4 ms median: one slow step
                              "sched_s": pytest.approx(0.020), "slow_steps": 1, "slow_sched_s": pytest.approx(0.013),
                              "decode_graph_pct": None,  # a log before each step's own replays
                              "path_pages": None, "decode_steps_with_path_pages": None}  # no pool counts
    assert runs[1].result["sched_ms_p50"] == pytest.approx(5.0) and runs[1].result["sched_steps"] == 1
    # With the replay count (cumulative, the 6th field): 30 replays over the window's 3 steps.
    log.write_text("".join(json.dumps([*r, 10 * i]) + "\n" for i, r in enumerate(rows)))
    bs.add_step_times(log, [(runs[0], 10.0, 13.0)])
    assert runs[0].result["graph_replays_per_step"] == pytest.approx(10.0)
    with pytest.raises(RuntimeError, match="no step of native saturation"):
        bs.add_step_times(log, [(runs[0], 40.0, 50.0)])
    with pytest.raises(RuntimeError, match="wrote no step log"):
        bs.add_step_times(tmp_path / "none.jsonl", [(runs[0], 10.0, 13.0)])
    sess = bs.Session(("saturation",), {"1b": 8}, tmp_path, bs.SETUPS["cuda"])
    plain = {k: v for k, v in _result(1.0).items() if not k.startswith("sched_")}
    sess.runs += [bs.PhaseRun("1b", "native", 1, config, plain), bs.PhaseRun("1b", "kvcached", 1, config, _result(1.0))]
    assert "sched_ms_p50" not in {c["metric"] for c in bs.compare(sess, "1b", "saturation")}
    sess.runs[0].result |= {"sched_ms_p50": 5.0, "sched_ms_p95": 5.0}
    row = next(c for c in bs.compare(sess, "1b", "saturation") if c["metric"] == "sched_ms_p50")
    assert row["ratios"] == [2.0] and row["target"] is None


def test_a_run_saved_before_the_diagnostic_options_resumes_as_a_plain_run(tmp_path: Path) -> None:
    old_plan = {"device": "cuda", "models": ["1b"], "phases": ["saturation", "rate"], "prompts": {"1b": 8}, "rounds": 3}
    plan = {**old_plan, "kvcached_env": [], "step_times": False}
    sess, _ = bs.resume(_cut_short(tmp_path, old_plan), plan, tmp_path)
    assert len(sess.runs) == 6
    with pytest.raises(SystemExit, match=r"step_times: saved False, asked True"):
        bs.resume(_cut_short(tmp_path, old_plan), {**plan, "step_times": True}, tmp_path)


def test_a_run_of_fewer_rounds_than_a_verdict_needs_is_reported_not_judged(tmp_path: Path) -> None:
    """One round proves nothing (issue 30): a run cut short after one or two rounds shows its
    ratios and says it gives no verdict; from `MIN_VERDICT_ROUNDS` on, the shared rule judges."""
    config = bs.PhaseConfig("saturation", float("inf"), 4, 8, 1)
    sess = bs.Session(("saturation",), {"1b": 8}, tmp_path, bs.SETUPS["cuda"])
    for rnd in range(1, bs.MIN_VERDICT_ROUNDS + 1):
        sess.runs += [bs.PhaseRun("1b", "native", rnd, config, _result(1.0)),
                      bs.PhaseRun("1b", "kvcached", rnd, config, _result(0.5))]
        row = next(c for c in bs.compare(sess, "1b", "saturation") if c["metric"] == "output_throughput")
        if rnd < bs.MIN_VERDICT_ROUNDS:
            assert row["verdict"] == f"no verdict ({rnd} of the {bs.MIN_VERDICT_ROUNDS} rounds a verdict needs)"
        else:
            assert row["verdict"] == "missed" and row["ratios"] == [0.5] * rnd
    doc = bs.report(bs.Session(("saturation",), {"1b": 8}, tmp_path, bs.SETUPS["cuda"], runs=sess.runs[:2]),
                    {"environment": {"command": "t", "date": "d"}, "rounds": 1, "setup": bs.asdict(bs.SETUPS["cuda"]),
                     "load_before": 0.0}, [bs.GPU_MODELS["1b"]])
    assert bs.build(json.loads(json.dumps(bs._jsonable(doc)))).headline == "No verdict: 1 round(s) on both sides, 3 needed."


def test_step_stats_summarizes_a_step_log_as_the_phase_metrics(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--step-stats LOG``: a committed step log's metrics, by the rule the run uses (`step_stats`)."""
    log = tmp_path / "kvcached.steps.jsonl"
    rows = [[1.0, 0.001, 0.001, 8, 8, 0], [1.01, 0.001, 0.001, 8, 8, 1], [1.02, 0.0, 0.0, 0, 0, 1],
            [1.03, 0.020, 0.002, 8, 8, 2]]
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert bs.step_log_main([str(log)]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["sched_steps"] == 3 and got["slow_steps"] == 1  # the idle step is left out; 22 ms > 3 x 2 ms
    assert got["slow_sched_s"] == pytest.approx(0.022) and got["sched_s"] == pytest.approx(0.026)
    # A log kept under reports/ is xz-compressed: read as it is, to the same metrics.
    packed = tmp_path / "kvcached.steps.jsonl.xz"
    packed.write_bytes(lzma.compress(log.read_bytes()))
    assert bs.step_log_main([str(packed)]) == 0
    assert {k: v for k, v in json.loads(capsys.readouterr().out).items() if k != "log"} == \
        {k: v for k, v in got.items() if k != "log"}
    log.write_text(json.dumps([1.0, 0.0, 0.0, 0, 0]) + "\n")
    with pytest.raises(SystemExit, match="no step that ran work"):
        bs.step_log_main([str(log)])


def test_pages_on_the_schedulers_path_are_each_steps_own_change_of_the_pools_counts() -> None:
    """A row ends with the pool's counts so far (maps, unmaps, blocking maps, blocking unmaps):
    each step's own pages on the scheduler's path are its change of blocking maps + blocking
    unmaps since the row before, an idle row's included; maps and unmaps sent ahead are not
    on the path. A log from before blocking unmaps were counted takes every unmap as one."""
    rows = [[1.0, 0.001, 0.001, 4, 64, 0, 10, 0, 10, 0],  # the first: no row before it
            [1.1, 0.001, 0.001, 4, 4, 0, 12, 0, 10, 0],   # decode, 2 maps sent ahead: none on the path
            [1.2, 0.001, 0.001, 4, 4, 0, 13, 2, 11, 0],   # decode, 1 blocking map, 2 unmaps sent ahead: 1
            [1.3, 0.0, 0.0, 0, 0, 0, 13, 5, 11, 3],       # idle: its 3 unmaps waited for are its own
            [1.4, 0.001, 0.001, 4, 40, 0, 14, 5, 12, 3]]  # prefill: 1 blocking map
    annotated = bs.annotate_rows(rows)
    assert [r[bs.PATH_PAGES] for r in annotated] == [None, 0, 1, 3, 1]
    busy = [r for r in annotated if r[3] > 0]
    assert bs.path_pages(busy) == {"path_pages": 2, "decode_steps_with_path_pages": 1}
    before = bs.annotate_rows([r[:9] for r in rows])  # 12-05's logs: 9 fields, unmaps all blocking
    assert [r[bs.PATH_PAGES] for r in before] == [None, 0, 3, 3, 1] and all(len(r) == 13 for r in before)
    old = bs.annotate_rows([[1.0, 0.001, 0.001, 4, 4, 7], [1.1, 0.001, 0.001, 4, 4, 9]])  # a log before the counts
    assert bs.path_pages(old) == {"path_pages": None, "decode_steps_with_path_pages": None}
    assert bs.step_stats(old)["graph_replays_per_step"] == pytest.approx(1.0)


def test_a_phases_prefix_hit_rate_is_the_change_of_the_servers_counters() -> None:
    """``prefix_hit_pct``: the prompt tokens the prefix cache served between two readings of a
    server's /metrics, over those asked for; None without the counters (stat logger off)."""
    text = """# HELP vllm:prefix_cache_queries_total Prefix cache queries
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 1000.0
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 170.0
vllm:prefix_cache_hits_created{engine="0",model_name="tiny"} 1.7e9
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
"""
    before = bs.parse_prefix_counts(text)
    assert before == {"queries": 1000.0, "hits": 170.0}
    after = bs.parse_prefix_counts(text.replace("1000.0", "3000.0").replace(" 170.0", " 770.0"))
    assert bs.prefix_hit_pct(before, after) == pytest.approx(30.0)  # 600 of 2000
    assert bs.prefix_hit_pct(after, after) is None  # nothing asked between them
    assert bs.parse_prefix_counts("vllm:num_requests_running 3.0\n") is None
    assert bs.prefix_hit_pct(None, after) is None
    assert [m.key for m in bs.METRICS][-1] == "prefix_hit_pct"


def test_a_steps_own_replays_are_the_change_of_the_count_at_schedule_to_the_next_row() -> None:
    """The last field is the replay count when the step's schedule began; one step is launched
    between two schedules, so the next row's count less this one's is the step's own replays
    (the count at the update, field 5, already holds the next step's under async scheduling)."""
    pages = [0, 0, 0, 0]
    rows = [[1.0, 0.001, 0.001, 4, 4, 1, *pages, 0],    # decode: 1 replay (FULL graph)
            [1.1, 0.001, 0.001, 5, 300, 18, *pages, 1],  # mixed <= 512 tokens: 17 pieces
            [1.2, 0.001, 0.001, 5, 5, 18, *pages, 18],   # decode that fell back to eager: 0
            [1.3, 0.001, 0.001, 5, 5, 19, *pages, 18],   # decode: 1
            [1.4, 0.001, 0.001, 5, 5, 19, *pages, 19]]   # the last: its own replays unknown
    annotated = bs.annotate_rows(rows)
    assert [r[bs.OWN_REPLAYS] for r in annotated] == [1, 17, 0, 1, None]
    assert bs.decode_graph_pct(annotated) == pytest.approx(100 * 2 / 3)  # 2 of the 3 known decode steps
    assert bs.step_stats(annotated)["decode_graph_pct"] == pytest.approx(100 * 2 / 3)
    eager = bs.annotate_rows([[*r[:10], 0] for r in rows])  # no replay anywhere: eager, or a CPU
    assert bs.decode_graph_pct(eager) is None
    assert bs.decode_graph_pct(bs.annotate_rows([r[:10] for r in rows])) is None  # a log before the field


def _server(side: str, rnd: int, samples: dict[str, int] | None, steps: int = 10) -> dict[str, object]:
    return {"model": "1b", "side": side, "round": rnd,
            "samples": None if samples is None else {"interval_us": 100, "steps": steps, "samples": samples}}


def test_the_sampled_section_splits_each_sides_decode_steps_by_whose_code_ran() -> None:
    """``--step-samples``: per decode step, vLLM's time and each of kvcached's functions, median
    over the rounds that sampled both sides; a server without samples adds no round."""
    doc = {"servers": [
        _server("native", 1, {"schedule vllm": 100}),
        _server("kvcached", 1, {"schedule vllm": 110, "schedule kvcached kvcached.ledger:BlockLedger.allocate": 20}),
        _server("native", 2, {"schedule vllm": 100}),
        _server("kvcached", 2, {"schedule vllm": 130, "schedule kvcached kvcached.ledger:BlockLedger.allocate": 40}),
        _server("native", 3, None),  # an unsampled round counts for neither side
        _server("kvcached", 3, {"schedule vllm": 1000}),
    ]}
    section = bs._sampled_section(doc, "1b")
    assert section is not None
    rows = {(r["call"], r["code"]): r for r in section.blocks[1].frame.to_dict("records")}  # type: ignore[union-attr]
    # 10 decode steps a server, a sample every 100 µs: 100 samples = 1 ms a step.
    assert rows[("schedule", "vllm")]["native ms/step"] == "1.000"
    assert rows[("schedule", "vllm")]["kvcached ms/step"] == "1.200"  # median of 1.1 and 1.3
    assert rows[("schedule", "kvcached.ledger:BlockLedger.allocate")]["difference ms"] == "+0.300"
    assert rows[("schedule", "all")]["kvcached ms/step"] == "1.500"
    assert bs._sampled_section({"servers": [_server("native", 1, None)]}, "1b") is None
