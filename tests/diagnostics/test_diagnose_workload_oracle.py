"""The diagnose workload itself is right: a clean run reaches every forward mode and the host tier, all four
policies agree, and every phase (reserved slots, several steps in one forward, a mid-forward remap of the SWA
slots) matches a teacher-forced transformers forward over the same tokens. Without this, a wrong remap or
draft step would be invisible: the fault tests compare runs of this same workload with each other."""

import torch
from transformers import Gemma3ForCausalLM as HFGemma3ForCausalLM
from transformers import Gemma3TextConfig

from runtime.diagnose import PHASES, REQUIRED_COVERAGE
from runtime.models.config import Gemma3Config
from runtime.models.loader import random_state_dict
from runtime.models.registry import TINY_SEED


def test_clean_run_covers_every_mode_and_policies_agree(diagnose):
    report = diagnose()
    assert report.exit_status == 0 and report.failures == []
    assert [r for r in report.rows if not r.benign] == []
    for p in report.policies:
        cov = p.result.coverage
        assert all(cov[name] > 0 for name in REQUIRED_COVERAGE), cov
        assert cov["midforward_remaps"] == 2
        assert p.reference == "the uncached `off` run" and p.mismatches == []
    # benign rows only where two tensors are translated in one forward (the draft steps), memo only
    assert {(r.policy, r.site, r.classification, r.phase) for r in report.rows} == {
        ("memo", "kv_write", "benign_fresh_tensor", "draft_steps")}


def test_every_phase_matches_transformers(diagnose):
    config = Gemma3Config.tiny()
    hf = HFGemma3ForCausalLM._from_config(Gemma3TextConfig(**config.to_hf_dict(), attn_implementation="eager"),
                                          dtype=torch.float32)
    hf.load_state_dict(random_state_dict(config, seed=TINY_SEED), strict=False)
    hf.eval()
    run = {p.policy: p for p in diagnose().policies}["memo"].result
    for phase in PHASES:
        out = run.outputs[phase]
        assert len(out.prompts) >= 2
        for prompt, tokens, logits in zip(out.prompts, out.tokens, out.logits):
            assert len(prompt) > config.sliding_window and len(tokens) >= 2
            with torch.no_grad():
                ref = hf(input_ids=torch.tensor([prompt + tokens[:-1]])).logits[0].float()
            ref = ref[len(prompt) - 1:]
            torch.testing.assert_close(logits, ref, rtol=0, atol=1e-4, msg=lambda m: f"{phase}: {m}")
            assert tokens == ref.argmax(-1).tolist()
