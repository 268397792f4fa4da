"""The flag registry (hvdtrain.job.flags): every flag the plan emits comes from a spec key's declaration, and
extra_args cannot set one behind the spec's back in any spelling horovodrun's own parser accepts."""

from __future__ import annotations

import argparse
from unittest import mock

import pytest

from hvdtrain.job.flags import HOROVODRUN_OPTIONS, SCHEMA_KEY, all_flags, option_of
from hvdtrain.job.load import MODELED_FLAGS, SpecError, load_spec
from hvdtrain.job.model import JobSpec
from hvdtrain.job.plan import build_plan
from tests.support.harness import BIN, REPO, run_bounded

EVERY_KEY = """
script: train.py
np: 4
ssh: {port: 2222, identity_file: id}
network_interfaces: [eth0]
horovod: {fusion_threshold_mb: 0, cycle_time_ms: 2.5, cache_capacity: 1, hierarchical_allreduce: true,
  hierarchical_allgather: false, autotune: true, autotune_log_file: a.csv, timeline_file: t.json,
  timeline_mark_cycles: false, stall_check: false, stall_check_warning_s: 1, stall_check_shutdown_s: 2,
  log_level: INFO, gloo_timeout_s: 3, start_timeout_s: 4, num_nccl_streams: 1, tcp_only: true, verbose: true}
"""
ELASTIC = "elastic: {discovery_script: d.sh, min_np: 2, max_np: 8, slots_per_host: 2, reset_limit: 1, timeout_s: 5,"\
          " blacklist_cooldown_s: [1, 2]}\n"


class _Captured(Exception):
    pass


@pytest.fixture(scope="module")
def horovodrun_parser() -> argparse.ArgumentParser:
    """horovodrun's own argparse parser, as `horovodrun` builds it (stopped before it reads sys.argv)."""
    got: list[argparse.ArgumentParser] = []

    def grab(parser, *args, **kwargs):
        got.append(parser)
        raise _Captured

    from horovod.runner import launch
    with mock.patch.object(argparse.ArgumentParser, "parse_args", autospec=True, side_effect=grab), \
            pytest.raises(_Captured):
        launch.parse_args()
    return got[0]


def _reads_as(parser: argparse.ArgumentParser, arg: str) -> str | None:
    """The option horovodrun's parser takes `arg` for (None: a value; 'ambiguous' when it would refuse it)."""
    with mock.patch.object(parser, "error", side_effect=ValueError):
        try:
            found = parser._parse_optional(arg)
        except ValueError:
            return "ambiguous"
    found = found[0] if isinstance(found, list) and len(found) == 1 else found
    return found[1] if found and found[0] is not None else None


def test_the_option_list_is_horovodruns(horovodrun_parser):
    assert frozenset(horovodrun_parser._option_string_actions) == HOROVODRUN_OPTIONS


def test_every_registered_spelling_is_a_horovodrun_option():
    spellings = [s for _, flag in all_flags(JobSpec) for s in flag.spellings]
    assert spellings and not set(spellings) - HOROVODRUN_OPTIONS
    assert len(spellings) == len(set(spellings)), "one option claimed by two keys"


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
@pytest.mark.parametrize("elastic", [False, True], ids=["static", "elastic"])
def test_every_flag_the_plan_emits_is_guarded(controller, elastic):
    spec = load_spec(EVERY_KEY + (ELASTIC if elastic else "hosts: a:2,b:2\n"), "/jobs/job.yaml")
    argv = build_plan(spec, controller=controller).argv
    emitted = [a for a in argv[1:argv.index("-m") - 1] if a.startswith("-")]
    assert len(emitted) >= 24
    assert [a for a in emitted if option_of(a) not in MODELED_FLAGS] == []


def _shortest_abbreviation(option: str) -> str | None:
    for end in range(3, len(option)):
        if [o for o in HOROVODRUN_OPTIONS if o.startswith(option[:end])] == [option]:
            return option[:end]
    return None


def _spellings_to_try() -> list[tuple[str, str]]:
    cases = []
    for key, flag in all_flags(JobSpec):
        for spelling in flag.spellings:
            cases += [(key, spelling), (key, f"{spelling}=1")]
            if spelling.startswith("--") and (short := _shortest_abbreviation(spelling)):
                cases.append((key, short))
            if len(spelling) == 2:
                cases += [(key, f"{spelling}x"), (key, f"{spelling} x")]
    return cases


@pytest.mark.parametrize(("key", "arg"), _spellings_to_try())
def test_extra_args_cannot_set_a_modeled_flag_in_any_spelling(key, arg, horovodrun_parser):
    assert option_of(arg) == _reads_as(horovodrun_parser, arg) != "ambiguous"
    with pytest.raises(SpecError) as err:
        load_spec(f"script: train.py\nnp: 2\nextra_args: [{arg!r}]\n", "/jobs/job.yaml")
    assert f"extra_args[0]: {option_of(arg)}" in str(err.value) and f"spec key {key} sets" in str(err.value)


@pytest.mark.parametrize("arg", ["--disable-cache", "--mpi-args=--map-by ppr:2:node", "--binding-args", "x:1",
                                 "--thread-affinity=1", "--mpi-threads-disable", "--log-hide-timestamp", "-x",
                                 "--no-torus-allreduce", "--autotune-warmup-samples", "3", "--no-mpi", "--",
                                 "--log-", "-"])
def test_options_no_key_models_pass_as_horovodrun_reads_them(arg, horovodrun_parser):
    assert option_of(arg) == (None if _reads_as(horovodrun_parser, arg) == "ambiguous"
                              else _reads_as(horovodrun_parser, arg))
    spec = load_spec(f"script: train.py\nnp: 2\nextra_args: [{arg!r}]\n", "/jobs/job.yaml")
    assert build_plan(spec, controller="gloo").argv.count(arg) == 1


@pytest.mark.parametrize("arg", ["--check-build", "-cb", "--version", "--output-filename=logs", "--config-file",
                                 "--jsrun", "-prefix-timestamp", "--help"])
def test_options_hvdtrain_replaces_are_refused_with_what_to_use(arg):
    with pytest.raises(SpecError) as err:
        load_spec(f"script: train.py\nnp: 2\nextra_args: [{arg!r}]\n", "/jobs/job.yaml")
    assert "is not for extra_args: " in str(err.value) and "fix: remove it from extra_args; " in str(err.value)


def test_the_schema_lists_each_keys_flags_and_descriptions_lead_with_them():
    schema = JobSpec.model_json_schema()
    knobs = schema["$defs"]["HorovodKnobs"]["properties"]
    assert knobs["gloo_timeout_s"][SCHEMA_KEY] == ["--gloo-timeout-seconds"]
    assert knobs["gloo_timeout_s"]["description"].startswith("--gloo-timeout-seconds: ")
    assert knobs["stall_check"][SCHEMA_KEY] == ["--stall-check", "--no-stall-check"]
    assert schema["properties"]["np"][SCHEMA_KEY] == ["-np", "--num-proc"]
    listed = sum(len(p.get(SCHEMA_KEY, [])) for d in [schema, *schema["$defs"].values()]
                 for p in d.get("properties", {}).values())
    assert listed == len(MODELED_FLAGS)


def test_the_issue_example_is_refused_by_validate_and_dry_run(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(f"script: {REPO / 'recipes' / 'pytorch_train.py'}\nnp: 2\nhorovod: {{gloo_timeout_s: 30}}\n"
                   "extra_args: [--gloo-timeout-seconds=5]\n")
    for command in (["validate", str(job)], ["run", str(job), "--dry-run"]):
        res = run_bounded([str(BIN / "hvdtrain"), *command], timeout=60)
        assert res.returncode == 2, res.describe()
        assert f"{job}:4: extra_args[0]: --gloo-timeout-seconds is what the spec key horovod.gloo_timeout_s sets" \
               in res.output, res.describe()
        assert "--gloo-timeout-seconds 30" not in res.output
