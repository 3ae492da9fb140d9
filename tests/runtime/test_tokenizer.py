from tokenizers import Tokenizer, models, pre_tokenizers

from deepinfer.runtime.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer


def test_byte_fallback_round_trips_utf8_and_skips_special_ids(tmp_path):
    tok = load_tokenizer(tmp_path, vocab_size=320)
    assert isinstance(tok, ByteTokenizer)
    ids = tok.encode("héllo ✓")
    assert min(ids) >= 2 and max(ids) < 258
    assert tok.decode([0] + ids + [1, 300]) == "héllo ✓"


def test_tokenizer_json_is_used_when_present(tmp_path):
    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    hf = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path, vocab_size=3)
    assert isinstance(tok, HFTokenizer)
    assert tok.encode("hello world") == [1, 2]
