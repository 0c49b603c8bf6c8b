"""The diagnose workload itself is right: a clean run reaches every forward mode, memory path and the host
tier, every run of every policy and setup matches the dense reference, and every phase of every setup
(reserved slots, several steps in one forward, a mid-forward remap of the SWA slots, paged pools, padded and
wide batches) matches a teacher-forced transformers forward over the same tokens. Without this, a wrong remap
or draft step would be invisible: the workload's own outputs are what the reference is held against."""

import torch
from transformers import Gemma3ForCausalLM as HFGemma3ForCausalLM
from transformers import Gemma3TextConfig

from runtime.diagnose import PHASES, REQUIRED_COVERAGE, SETUPS
from runtime.mem_cache.paths import MEMORY_PATHS
from runtime.models.config import Gemma3Config
from runtime.models.loader import random_state_dict
from runtime.models.registry import TINY_SEED


def test_clean_run_covers_every_mode_and_path_and_matches_the_reference(diagnose):
    report = diagnose()
    assert report.exit_status == 0 and report.failures == []
    assert [r for r in report.rows if not r.benign] == []
    for p in report.policies:
        assert [r.setup for r in p.runs] == [s.name for s in SETUPS]
        cov = p.result.coverage  # the base setup alone reaches every runner branch and workload feature
        assert all(cov[name] > 0 for name in REQUIRED_COVERAGE), cov
        assert cov["midforward_remaps"] == 2
        for name in MEMORY_PATHS:
            assert sum(r.memory_paths[name] for r in p.runs) > 0, name
        assert p.reference == "the dense reference" and p.mismatches == []
    # benign rows only where two tensors are translated in one forward (the draft steps), memo only
    assert {(r.policy, r.site, r.classification, r.phase) for r in report.rows} == {
        ("memo", "kv_write", "benign_fresh_tensor", "draft_steps")}


def test_every_setup_runs_its_own_configuration(diagnose):
    runs = {r.setup: r for r in diagnose().policies[0].runs}
    cfg = {name: r.config for name, r in runs.items()}
    assert cfg["base"].page_size == 1 and cfg["paged"].page_size == 4 and cfg["no_prefix"].page_size == 4
    assert cfg["no_prefix"].disable_prefix_caching and cfg["no_host"].hicache_size == 0
    assert 0 < cfg["small_host"].hicache_size < cfg["base"].hicache_size
    assert runs["no_host"].memory_paths["retract_recompute"] > 0 and runs["no_host"].memory_paths["evict_to_host"] == 0
    assert runs["small_host"].memory_paths["host_drop"] > 0
    assert runs["paged"].memory_paths["alloc_partial_page"] > 0 and runs["base"].memory_paths["alloc_partial_page"] == 0
    wide = runs["wide"]
    assert wide.memory_paths["graph_replay_padded"] > 0  # batches of 3 in the graph of 4
    assert wide.memory_paths["decode_twice_graph_max"] > 0 and 2 * max(cfg["wide"].graph_batch_sizes) <= 8
    assert set().union(*(r.outputs for r in runs.values())) == set(PHASES)


def test_every_phase_matches_transformers(diagnose):
    config = Gemma3Config.tiny()
    hf = HFGemma3ForCausalLM._from_config(Gemma3TextConfig(**config.to_hf_dict(), attn_implementation="eager"),
                                          dtype=torch.float32)
    hf.load_state_dict(random_state_dict(config, seed=TINY_SEED), strict=False)
    hf.eval()
    memo = {p.policy: p for p in diagnose().policies}["memo"]
    for run in memo.runs:
        for phase, out in run.outputs.items():
            assert len(out.prompts) >= 2
            for prompt, tokens, logits in zip(out.prompts, out.tokens, out.logits):
                assert len(prompt) > config.sliding_window and len(tokens) >= 2
                with torch.no_grad():
                    ref = hf(input_ids=torch.tensor([prompt + tokens[:-1]])).logits[0].float()
                ref = ref[len(prompt) - 1:]
                torch.testing.assert_close(logits, ref, rtol=0, atol=1e-4, msg=lambda m: f"{run.setup}/{phase}: {m}")
                assert tokens == ref.argmax(-1).tolist()
