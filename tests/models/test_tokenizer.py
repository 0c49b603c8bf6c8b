import pytest

from runtime.models import tokenizer as tokenizer_module
from runtime.models.tokenizer import ByteTokenizer, load_tokenizer, tokenizer_cache_paths

SAMPLES = [
    "Hello world!",
    "  leading spaces,\ttabs and\n\nnewlines   ",
    "héllo wörld — naïve café, 日本語のテキスト, emoji 🙂👍",
    "<start_of_turn>user\nWhat is 12345 * 678?<end_of_turn>\n<start_of_turn>model\n",
    "def f(x):\n    return x ** 2  # squares\n",
    "",
]


def test_byte_tokenizer_round_trips_and_starts_with_bos():
    tok = load_tokenizer("tiny")
    assert isinstance(tok, ByteTokenizer)
    for text in SAMPLES:
        ids = tok.encode(text)
        assert ids[0] == tok.bos_token_id == 2
        assert all(4 <= i < 260 for i in ids[1:]) and len(ids) == 1 + len(text.encode("utf-8"))
        assert tok.decode(ids) == text
    assert tok.decode([2, 4 + ord("a"), 1], skip_special_tokens=False) == "<bos>a<eos>"
    assert tok.eos_token_ids == (1,)


@pytest.fixture(scope="module")
def hf_tokenizer(gemma3_gguf_path):
    """transformers' tokenizer converted from the same GGUF file (the oracle)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        str(gemma3_gguf_path.parent), gguf_file=gemma3_gguf_path.name, local_files_only=True
    )


@pytest.mark.slow
def test_gguf_tokenizer_is_converted_once_then_loaded_from_the_cache(gemma3_gguf_path, monkeypatch, tmp_path):
    monkeypatch.setenv("SWA_RUNTIME_CACHE_DIR", str(tmp_path))
    conversions = []
    convert = tokenizer_module._convert_gguf_tokenizer
    monkeypatch.setattr(tokenizer_module, "_convert_gguf_tokenizer", lambda p: conversions.append(p) or convert(p))

    first = load_tokenizer(gemma3_gguf_path)
    tok_file, special_file = tokenizer_cache_paths(gemma3_gguf_path)
    assert conversions == [gemma3_gguf_path]
    assert tok_file.parent == tmp_path / "tokenizers" and tok_file.is_file() and special_file.is_file()
    stamps = (tok_file.stat().st_mtime_ns, special_file.stat().st_mtime_ns)

    second = load_tokenizer(gemma3_gguf_path)
    assert conversions == [gemma3_gguf_path]  # not converted again
    assert (tok_file.stat().st_mtime_ns, special_file.stat().st_mtime_ns) == stamps
    assert [second.encode(s) for s in SAMPLES] == [first.encode(s) for s in SAMPLES]


@pytest.mark.slow
def test_hugging_face_directory_tokenizer_reads_tokenizer_json_and_stop_ids(gemma3_gguf_path, tmp_path):
    import json
    import shutil

    from runtime.models.config import Gemma3Config

    gguf_tok = load_tokenizer(gemma3_gguf_path)
    shutil.copy(tokenizer_cache_paths(gemma3_gguf_path)[0], tmp_path / "tokenizer.json")
    (tmp_path / "config.json").write_text(json.dumps(Gemma3Config.tiny().to_hf_dict()))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 106]}))
    tok = load_tokenizer(tmp_path)
    assert (tok.bos_token_id, tok.eos_token_ids) == (2, (1, 106))
    assert [tok.encode(s) for s in SAMPLES] == [gguf_tok.encode(s) for s in SAMPLES]


@pytest.mark.slow
def test_gguf_tokenizer_matches_transformers(gemma3_gguf_path, hf_tokenizer):
    tok = load_tokenizer(gemma3_gguf_path)
    assert (tok.bos_token_id, tok.eos_token_ids) == (2, (1, 106))  # <bos>; <eos> and <end_of_turn>
    assert hf_tokenizer.convert_ids_to_tokens(106) == "<end_of_turn>"
    for text in SAMPLES:
        ids = tok.encode(text)
        assert ids == hf_tokenizer.encode(text), text
        assert ids[0] == hf_tokenizer.bos_token_id == tok.bos_token_id
        for skip in (False, True):
            assert tok.decode(ids, skip_special_tokens=skip) == hf_tokenizer.decode(ids, skip_special_tokens=skip)
    # special tokens in the text are single tokens, not spelled out
    turn = tok.encode("<start_of_turn>user\n")
    assert turn[:2] == [2, hf_tokenizer.convert_tokens_to_ids("<start_of_turn>")]
    assert tok.decode(tok.encode("Hello world!")) == "Hello world!"
