"""Realistic bugs outside the `--inject` switches, each introduced by a patch of the engine's own code, run
through the diagnose workload (tiny model, memo policy) and held against the uncached `off` run and the dense
reference:

1. a location buffer rewritten in place by a write no version counter sees (a draft runner refilling one
   buffer through numpy), and a mapping written that way (a fast-path slot mover writing through numpy);
2. address reuse: a per-layer temporary location tensor, freed and reallocated at the same address;
3. mapping writes outside the hooked mutations: a helper moving slots with plain tensor indexing, and a
   pool adopting a rebuilt mapping by rebinding the attribute;
4. diagnose itself: ground truth is the dense reference whatever the settings, and every runner branch must run.

For each: a non-benign event with the right classification and cause is counted; with default settings the
outputs equal the uncached run, or (the numpy mapping write) the event is counted on the very forward whose
output first differs; with the strict setting (`--loc-cache-verify 1`) the outputs always equal it.
"""

import contextlib

import pytest
import torch

from runtime.diagnose import run_diagnose
from runtime.diagnose.workload import PHASES, SETUPS, Workload, compare, run_workload
from runtime.executor import model_runner
from runtime.executor.model_runner import ModelRunner
from runtime.mem_cache.hybrid import HybridAllocator
from runtime.mem_cache.swa_pool import HybridKVPool
from runtime.models.loader import load_model
from runtime.models.tokenizer import load_tokenizer

UNHOOKED = "mapping changed outside every hooked mutation"


# ---- the bugs ---------------------------------------------------------------------------------------------
def numpy_refilled_draft_buffer(mp):
    """A multi-step decoder that copies each step's locations into one persistent buffer through numpy."""
    original = ModelRunner.multi_step

    @contextlib.contextmanager
    def multi_step(self):
        with original(self) as step:
            buffer = None

            def run(batch):
                nonlocal buffer
                if buffer is None:
                    buffer = batch.out_cache_loc.clone()
                buffer.numpy()[:] = batch.out_cache_loc.numpy()  # host-side refill: no version bump
                batch.out_cache_loc = buffer
                return step(batch)

            yield run

    mp.setattr(ModelRunner, "multi_step", multi_step)


def numpy_mapping_writer(mp):
    """A fast-path slot mover: writes the mapping through numpy and skips the allocator's hooks."""

    def set_full_to_swa_mapping(self, full_locs, swa_locs):
        self.full_to_swa_index_mapping.numpy()[full_locs.numpy()] = swa_locs.numpy()

    mp.setattr(HybridAllocator, "set_full_to_swa_mapping", set_full_to_swa_mapping)


def per_layer_temporary(mp):
    """Each sliding layer translates its own copy of the write location (e.g. a slice copy or a cast)."""
    original = HybridKVPool.set_kv_buffer

    def set_kv_buffer(self, layer_id, loc, k, v, swa_loc=None):
        return original(self, layer_id, loc.clone(), k, v, swa_loc)

    mp.setattr(HybridKVPool, "set_kv_buffer", set_kv_buffer)


def unhooked_slot_mover(mp):
    """A new helper that moves slots with ordinary tensor indexing but calls no hooked mutation."""

    def set_full_to_swa_mapping(self, full_locs, swa_locs):
        self.full_to_swa_index_mapping[full_locs.long()] = swa_locs.long()

    mp.setattr(HybridAllocator, "set_full_to_swa_mapping", set_full_to_swa_mapping)


def rebinding_pool(mp):
    """The pool adopts a rebuilt mapping by rebinding the allocator's attribute instead of registering it."""

    def register_mapping(self, mapping, site="register_mapping"):
        self.allocator.full_to_swa_index_mapping = mapping

    mp.setattr(HybridKVPool, "register_mapping", register_mapping)


# ---- running them -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    _, net = load_model("tiny", progress=False)
    tokenizer = load_tokenizer("tiny")
    work = Workload(window=net.config.sliding_window, vocab=net.config.vocab_size)
    torch.set_num_threads(1)
    return net, tokenizer, work


@pytest.fixture(scope="module")
def truth(tiny):
    net, tokenizer, work = tiny
    return run_workload(work.engine_config("tiny", "off"), work, net, tokenizer)


def workload(tiny, verify=0.0):
    net, tokenizer, work = tiny
    return run_workload(work.engine_config("tiny", "memo", loc_cache_verify=verify), work, net, tokenizer)


def stale_events(run):
    return {k: v for k, v in run.key_change_counts.items() if k[1] == "stale_loc"}


def first_differing_forward(run, truth, phase):
    """Forward id of the first token of `phase` whose logits differ (the direct phases: prefill, then one
    forward per decode step)."""
    mine, ref = run.outputs[phase].logits, truth.outputs[phase].logits
    steps = min(len(m) for m in mine)
    for t in range(steps):
        if any(float((m[t] - r[t]).abs().max()) > 1e-5 for m, r in zip(mine, ref)):
            return run.phase_starts[phase] + t
    return None


CLASSES = {
    # bug: (phase where it shows, what the first stale_loc event's cause starts with, default outputs equal)
    "numpy_refilled_draft_buffer": (numpy_refilled_draft_buffer, "draft_steps",
                                    "loc buffer rewritten in place by a write no version counter sees", True),
    "numpy_mapping_writer": (numpy_mapping_writer, "midforward_remap",
                             f"{UNHOOKED}: a write no version counter sees", False),
    # where the allocator first hands a freed temporary's address out again depends on its state: any phase
    "per_layer_temporary": (per_layer_temporary, None, "address reuse", True),
    "unhooked_slot_mover": (unhooked_slot_mover, "midforward_remap",
                            f"{UNHOOKED}: written in place (its version counter moved)", True),
    "rebinding_pool": (rebinding_pool, "scheduler", f"{UNHOOKED}: the mapping attribute was rebound", True),
}


@pytest.mark.parametrize("name", CLASSES)
def test_each_bug_is_counted_attributed_and_survived(tiny, truth, name, monkeypatch):
    bug, phase, cause, default_equal = CLASSES[name]
    bug(monkeypatch)
    run = workload(tiny)
    (count,) = stale_events(run).values()
    assert count >= 1
    first = run.first_events["kv_write", "stale_loc"]
    assert first.cause.startswith(cause), first.cause
    assert phase is None or run.phase_of(first.forward_id) == phase
    attributed(name, first)
    mismatches = compare(run, truth)
    if default_equal:
        assert mismatches == []
    else:  # counted on the very forward whose output first differs
        assert [m.phase for m in mismatches] == [phase]
        assert first.forward_id == first_differing_forward(run, truth, phase)
    strict = workload(tiny, verify=1.0)
    assert compare(strict, truth) == []
    assert stale_events(strict), "the strict run must still count the event"


def attributed(name, first):
    """The event names the right thing: the translate site, the forward, and for an unhooked mapping write when
    it happened and the last hooked mutation before it; for a location buffer, the code that translated it."""
    assert first.site == "kv_write" and first.classification == "stale_loc"
    if UNHOOKED in first.cause:
        # found in the forward that wrote it (the remap's, or the one after the engine's load-back), after the
        # previous one ended; the allocator's last hooked mutation before it was that forward's allocation
        assert f"written after forward {first.forward_id - 1} ended, by forward {first.forward_id} ({first.mode})" \
            in first.cause, first.cause
        assert first.cause.endswith("last hooked mutation: alloc"), first.cause
    else:  # the location buffer: the entry was filled earlier in the same forward, at the same site
        assert (first.prev_site, first.prev_forward_id) == ("kv_write", first.forward_id)
        assert "set_kv_buffer" in first.stack
    if name == "per_layer_temporary":  # the patched layer call that made the temporary is on the stack
        assert "test_bug_classes.py" in first.stack and "set_kv_buffer" in first.stack


@pytest.mark.parametrize("name", CLASSES)
def test_diagnose_fails_with_a_classified_row_for_each_bug(name, monkeypatch):
    bug, phase, cause, default_equal = CLASSES[name]
    bug(monkeypatch)
    report = run_diagnose(policies=("memo",))
    assert report.exit_status == 1
    rows = [r for r in report.rows if r.classification == "stale_loc"]
    assert rows and rows[0].first.cause.startswith(cause) and phase in (None, rows[0].phase)
    assert any(f.startswith("memo: ") and f.endswith("stale_loc event(s) at kv_write") for f in report.failures)
    # the bug is in the build, so a clean run of the same policy would corrupt the same way and compare equal:
    # only a reference outside the build shows the corruption (the numpy mapping write, which the default can
    # return), in the phase where its event was counted (so not as an undetected corruption), in every setup
    # that runs the phase
    differ = [f for f in report.failures if "outputs differ" in f]
    if default_equal:
        assert differ == []
    else:
        assert differ and all(f.startswith("memo: outputs differ from the dense reference: ") for f in differ)
        assert {f.split(": ")[2] for f in differ} == {phase, f"paged/{phase}"}


def test_the_dense_reference_is_the_ground_truth_whatever_the_settings():
    for guard, verify in ((False, 0.0), (True, 0.5)):
        report = run_diagnose(policies=("memo",), guard=guard, verify=verify, inject=("skip-forward-invalidation",))
        assert report.policies[0].reference == "the dense reference"
    # guard off with the forward-entry fault corrupts: the mismatch is against ground truth, not itself
    assert report.exit_status == 1


def test_a_runner_branch_the_workload_never_takes_fails_diagnose(monkeypatch):
    monkeypatch.setattr(model_runner, "BRANCHES", (*model_runner.BRANCHES, "speculative_verify"))
    report = run_diagnose(policies=("memo",))
    assert "memo: the workload did not exercise speculative_verify" in report.failures


def test_the_workload_decodes_batches_larger_than_the_largest_graph_size(tiny):
    net, tokenizer, work = tiny
    cfg = work.engine_config("tiny", "memo")
    run = run_workload(cfg, work, net, tokenizer)
    assert max(cfg.graph_batch_sizes) < 3 and run.coverage["eager_decode"] > 0
    assert list(run.outputs) == list(SETUPS[0].phases) and set(SETUPS[0].phases) < set(PHASES)
