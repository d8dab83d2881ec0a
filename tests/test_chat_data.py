"""Instruction/chat examples for ``torchloom train --data FILE.jsonl``
(:mod:`torchloom.apps.chat_data`).

The tokenizer is a byte-level BPE trained offline on a few sentences, with ``<|im_start|>``
and ``<|im_end|>`` as special tokens, a bos added to every text, and a ChatML template;
it is saved with ``save_pretrained`` and read back through ``AutoTokenizer`` as a run
reads a model folder. Checks that can fail independently of the module:

* the tokens in the loss are the assistant turns: counted and decoded here from the
  tokenizer on the contents alone, not from the module's spans;
* packed rows: the logits of a packed (and padded) row equal those of each example run
  alone on tiny default-config Llama and Qwen2 models (sdpa and eager), and the summed loss
  equals the sum of the examples' losses (no loss across a boundary); the models whose
  attention mixes packed examples (Bloom, OPT) really do, and check_packing refuses them;
* every bad line is a DataError naming the file and the line.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from torchloom.apps import chat_data as C
from torchloom.core.errors import DataError

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
STRICT = ("{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
          "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}<|im_start|>"
          "{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}")
LAST_MARKED = ("{% for m in messages %}{% if loop.last %}LAST {% endif %}{{ m['role'] }}: "
               "{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant: "
               "{% endif %}")
CORPUS = ("You are a helpful assistant. What is two plus two? Two plus two is four. "
          "Tell me a joke about cats. Cats sleep all day, that is the joke. hello there "
          "system user assistant Thanks! You're welcome.") * 4

SYSTEM = "You are a helpful assistant."
CONVERSATION = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "Two plus two is four."},
    {"role": "user", "content": "Tell me a joke about cats."},
    {"role": "assistant", "content": "Cats sleep all day, that is the joke."},
]


def make_tokenizer() -> Any:
    """A byte-level BPE tokenizer with a bos on every text and ChatML special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator([CORPUS], trainers.BpeTrainer(
        vocab_size=320, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[
        ("<s>", tok.token_to_id("<s>"))])
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        extra_special_tokens=["<|im_start|>", "<|im_end|>"])


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    """Model folders with only a tokenizer: ChatML, no template, a template that marks the
    last message (it breaks the prefix property)."""
    root = tmp_path_factory.mktemp("tok")
    tokenizer = make_tokenizer()
    out = {}
    for name, template in (("chatml", CHATML), ("plain", None), ("last", LAST_MARKED),
                           ("strict", STRICT)):
        tokenizer.chat_template = template
        tokenizer.save_pretrained(root / name)
        out[name] = str(root / name)
    return out


@pytest.fixture(scope="module")
def tok(folders) -> Any:
    return transformers.AutoTokenizer.from_pretrained(folders["chatml"], local_files_only=True)


def write(path: Path, *lines: Any) -> str:
    """A .jsonl file: objects are dumped, strings written as they are."""
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n"
                            for x in lines), encoding="utf-8")
    return str(path)


def counted(row: C.Row) -> list[int]:
    return [t for t in row.labels.tolist() if t != C.IGNORE_INDEX]


def plain_ids(tok: Any, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


# --------------------------------------------------------------------------- what counts


def test_messages_count_only_the_assistant_turns(tok, folders, tmp_path):
    path = write(tmp_path / "chat.jsonl", {"messages": CONVERSATION, "id": 7})
    corpus = C.load_examples([path], folders["chatml"], seq_len=256)
    (row,) = corpus.rows
    end = tok.convert_tokens_to_ids("<|im_end|>")
    answers = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]
    # the row is the template's rendering, and the counted tokens are each answer's own
    # tokens followed by <|im_end|> (not its newline), in order
    assert row.input_ids.tolist() == tok.apply_chat_template(CONVERSATION, return_dict=False)
    expected = [t for a in answers for t in plain_ids(tok, a) + [end]]
    assert counted(row) == expected
    assert corpus.response_tokens == len(expected) == sum(len(plain_ids(tok, a)) + 1
                                                          for a in answers)
    assert tok.decode(counted(row)) == "".join(a + "<|im_end|>" for a in answers)
    # every other token (system, user, headers, newlines) is out of the loss
    labels, ids = row.labels.tolist(), row.input_ids.tolist()
    assert all(lab in (C.IGNORE_INDEX, t) for lab, t in zip(labels, ids))
    out = tok.decode([t for t, lab in zip(ids, labels) if lab == C.IGNORE_INDEX])
    for m in CONVERSATION:
        if m["role"] != "assistant":
            assert m["content"] in out
    assert row.position_ids.tolist() == list(range(len(ids)))
    assert corpus.tokens == len(ids) and corpus.tokenizer == folders["chatml"]
    assert corpus.pad_id == tok.eos_token_id and corpus.largest == max(ids)


def test_control_tokens_in_messages_are_text(tok, folders, tmp_path):
    """A literal <|im_end|> in a user's text does not end its turn (untrusted data)."""
    messages = [{"role": "user", "content": "hello <|im_end|> there"},
                {"role": "assistant", "content": "Thanks!"}]
    path = write(tmp_path / "inject.jsonl", {"messages": messages})
    (row,) = C.load_examples([path], folders["chatml"], seq_len=256).rows
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert row.input_ids.tolist().count(end) == 2
    assert tok.decode(counted(row)) == "Thanks!<|im_end|>"


def test_prompt_response_with_a_tokenizer(tok, folders, tmp_path):
    prompt, response = "What is two plus two?", " Two plus two is four."
    path = write(tmp_path / "pairs.jsonl", {"prompt": prompt, "response": response})
    corpus = C.load_examples([path], folders["plain"], seq_len=256)
    (row,) = corpus.rows
    p, r = plain_ids(tok, prompt), plain_ids(tok, response)
    assert row.input_ids.tolist() == [tok.bos_token_id] + p + r + [tok.eos_token_id]
    assert counted(row) == r + [tok.eos_token_id]
    assert row.labels[:1 + len(p)].tolist() == [C.IGNORE_INDEX] * (1 + len(p))
    assert corpus.response_tokens == len(r) + 1


def test_bytes_without_a_tokenizer(tmp_path):
    path = write(tmp_path / "b.jsonl",
                 {"prompt": "Q: ", "response": "héllo"},
                 {"messages": [{"role": "system", "content": "be brief"},
                               {"role": "user", "content": "hi"},
                               {"role": "assistant", "content": "ok"},
                               {"role": "tool", "content": "42"},
                               {"role": "assistant", "content": "done"}]})
    corpus = C.load_examples([path], None, seq_len=256)
    pair, chat = corpus.rows
    assert bytes(pair.input_ids.tolist()) == "Q: héllo".encode()
    assert bytes(counted(pair)) == "héllo".encode()          # 6 bytes
    text = "system: be brief\nuser: hi\nassistant: ok\ntool: 42\nassistant: done\n"
    assert bytes(chat.input_ids.tolist()) == text.encode()
    assert bytes(counted(chat)) == b"ok\ndone\n"
    assert corpus.response_tokens == 6 + 8 and corpus.tokens == 9 + len(text)
    assert corpus.tokenizer is None and corpus.pad_id == 0 and corpus.examples == 2


def test_the_first_token_of_an_example_never_counts(tmp_path):
    """An empty prompt: the response's first byte has nothing before it to predict it."""
    path = write(tmp_path / "e.jsonl", {"prompt": "", "response": "abc"})
    (row,) = C.load_examples([path], None, seq_len=8).rows
    assert row.labels.tolist() == [C.IGNORE_INDEX, ord("b"), ord("c")]


def test_truncation_is_counted_and_kept(tmp_path):
    path = write(tmp_path / "t.jsonl",
                 {"prompt": "abcdefgh", "response": "ij"},        # 10 bytes: cut to 8
                 {"prompt": "ab", "response": "cdefghijkl"},       # 12 bytes: cut to 8
                 {"prompt": "a", "response": "b"})
    corpus = C.load_examples([path], None, seq_len=8)
    assert corpus.truncated == 2 and corpus.examples == 3 and len(corpus.rows) == 3
    assert [r.input_ids.numel() for r in corpus.rows] == [8, 8, 2]
    assert counted(corpus.rows[0]) == []                           # kept, nothing counts
    assert bytes(counted(corpus.rows[1])) == b"cdefgh"
    assert corpus.response_tokens == 7 and corpus.tokens == 18
    assert corpus.description == ("1 file: 3 examples (2 truncated to 8 tokens), 18 tokens "
                                  "(bytes), 7 in the loss (responses only), one row each")


def test_a_corpus_with_nothing_in_the_loss_is_refused(tmp_path):
    path = write(tmp_path / "t.jsonl", {"prompt": "abcdefgh", "response": "ij"})
    with pytest.raises(DataError, match=r"no token of the 1 examples counts in the loss "
                       r"\(1 truncated to seq_len 8: their responses were cut off\)"
                       r"(.|\n)*fix: raise --seq-len"):
        C.load_examples([path], None, seq_len=8)


# --------------------------------------------------------------------------- packing


def pair_lines(n: int) -> list[dict[str, str]]:
    return [{"prompt": f"q{i}:" + "x" * (i % 4), "response": "ans" + "y" * (i % 5)}
            for i in range(n)]


def test_packing_fills_rows_in_order(tmp_path):
    lines = pair_lines(12)
    paths = [write(tmp_path / "a.jsonl", *lines[:7]), write(tmp_path / "b.jsonl", *lines[7:])]
    plain = C.load_examples(paths, None, seq_len=24)
    packed = C.load_examples(paths, None, seq_len=24, pack=True)
    sizes = [len(x["prompt"]) + len(x["response"]) for x in lines]
    rows: list[list[int]] = [[]]                 # the greedy first fit, written again
    for size in sizes:
        if sum(rows[-1]) + size > 24:
            rows.append([])
        rows[-1].append(size)
    assert [r.input_ids.numel() for r in packed.rows] == [sum(r) for r in rows]
    assert len(packed.rows) < len(plain.rows) == 12
    for row, parts in zip(packed.rows, rows):
        starts = [sum(parts[:i]) for i in range(len(parts))]
        assert row.position_ids.tolist() == [p for s in parts for p in range(s)]
        assert all(row.labels[s] == C.IGNORE_INDEX for s in starts)
    assert torch.equal(torch.cat([r.input_ids for r in packed.rows]),
                       torch.cat([r.input_ids for r in plain.rows]))
    assert torch.equal(torch.cat([r.labels for r in packed.rows]),
                       torch.cat([r.labels for r in plain.rows]))
    assert packed.response_tokens == plain.response_tokens > 0
    assert packed.tokens == plain.tokens == sum(sizes)
    assert packed.description == (f"2 files: 12 examples, {sum(sizes)} tokens (bytes), "
                                  f"{plain.response_tokens} in the loss (responses only), "
                                  f"packed into {len(rows)} rows")


def tiny(kind: str, attn: str, vocab: int = 256) -> torch.nn.Module:
    """transformers' default config of ``kind``, sizes shrunk."""
    sizes = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                 max_position_embeddings=128)
    config: Any
    if kind == "llama":
        config, cls = transformers.LlamaConfig(**sizes), transformers.LlamaForCausalLM
    elif kind == "qwen2":
        config, cls = transformers.Qwen2Config(**sizes), transformers.Qwen2ForCausalLM
    elif kind == "bloom":
        config = transformers.BloomConfig(n_layer=2, hidden_size=32, n_head=4,
                                          vocab_size=vocab)
        cls = transformers.BloomForCausalLM
    elif kind == "opt":
        config = transformers.OPTConfig(num_hidden_layers=2, hidden_size=32, ffn_dim=64,
                                        num_attention_heads=4, vocab_size=vocab,
                                        max_position_embeddings=128, word_embed_proj_dim=32)
        cls = transformers.OPTForCausalLM
    config._attn_implementation = attn
    torch.manual_seed(0)
    return cls(config).eval()


@pytest.fixture(scope="module")
def packed_row(tmp_path_factory) -> tuple[C.ExampleCorpus, list[int]]:
    """One row of three packed examples (lengths given), padded by example_batch to 40."""
    path = write(tmp_path_factory.mktemp("pk") / "p.jsonl",
                 {"prompt": "one plus one? ", "response": "two."},
                 {"messages": [{"role": "user", "content": "hi"},
                               {"role": "assistant", "content": "hello"}]},
                 {"prompt": "x", "response": "yz"})
    corpus = C.load_examples([path], None, seq_len=48, pack=True)
    assert len(corpus.rows) == 1
    return corpus, [18, 26, 3]


def separate_logits(model: torch.nn.Module, ids: torch.Tensor,
                    lengths: list[int]) -> list[torch.Tensor]:
    out, start = [], 0
    for n in lengths:
        out.append(model(input_ids=ids[None, start:start + n], use_cache=False).logits[0])
        start += n
    return out


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@torch.no_grad()
def test_packed_logits_equal_each_example_alone(kind, attn, packed_row):
    corpus, lengths = packed_row
    model = tiny(kind, attn)
    C.check_packing(model)
    batch = C.example_batch(corpus, step=1, batch_size=1, seq_len=48, seed=0)
    n = sum(lengths)
    assert batch["position_ids"][0].tolist() == [p for k in lengths for p in range(k)] + \
        list(range(lengths[-1], lengths[-1] + 48 - n))
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                   use_cache=False).logits[0]
    alone = separate_logits(model, batch["input_ids"][0], lengths)
    torch.testing.assert_close(logits[:n], torch.cat(alone), atol=1e-5, rtol=0)
    if kind == "llama" and attn == "sdpa":
        # the loss of the packed row is the sum of the examples' losses (no loss across a
        # boundary, none on padding): num_items_in_batch=1 turns the mean into a sum
        loss = model(**batch, use_cache=False, num_items_in_batch=1).loss
        labels, start, total = batch["labels"][0], 0, 0.0
        for k in lengths:
            total += model(input_ids=batch["input_ids"][:, start:start + k],
                           labels=labels[None, start:start + k], use_cache=False,
                           num_items_in_batch=1).loss
            start += k
        torch.testing.assert_close(loss, torch.as_tensor(total), atol=1e-4, rtol=1e-6)
        # transformers reads packing only without a KV cache: a default config
        # (use_cache=True) builds one, and the examples then see each other
        cached = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        assert (cached[0, lengths[0]:n] - torch.cat(alone[1:])).abs().max() > 1e-3


@torch.no_grad()
def test_right_padding_changes_no_logit(tmp_path):
    path = write(tmp_path / "u.jsonl", {"prompt": "one plus one? ", "response": "two."})
    corpus = C.load_examples([path], None, seq_len=32)
    model = tiny("llama", "sdpa")
    batch = C.example_batch(corpus, step=1, batch_size=2, seq_len=32, seed=3)
    assert batch["position_ids"][0].tolist() == list(range(32))
    assert batch["input_ids"][0, 18:].eq(corpus.pad_id).all()
    assert batch["labels"][0, 18:].eq(C.IGNORE_INDEX).all()
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                   use_cache=False).logits
    alone = model(input_ids=corpus.rows[0].input_ids[None], use_cache=False).logits
    torch.testing.assert_close(logits[:, :18], alone.expand(2, -1, -1), atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind, attn, problem", [
    ("bloom", "eager", r"BloomForCausalLM\.forward takes no position_ids"),
    ("opt", "sdpa", r"OPTDecoder\.forward builds its causal mask without position_ids "
                    r"\(line \d+ of the forward\), so the examples of a row would attend to "
                    r"each other"),
])
@torch.no_grad()
def test_check_packing_refuses_models_that_mix_examples(kind, attn, problem, packed_row):
    corpus, lengths = packed_row
    model = tiny(kind, attn)
    with pytest.raises(DataError, match=r"^torchloom train\(\.\.\.\): --pack needs a model "
                       r"whose attention keeps the examples of a row apart; .*" + problem
                       + r"(.|\n)*fix: train without --pack"):
        C.check_packing(model)
    # and rightly so: the second example's logits depend on the first one
    row = corpus.rows[0]
    kwargs = {"position_ids": row.position_ids[None]} if kind == "opt" else {}
    logits = model(input_ids=row.input_ids[None], use_cache=False, **kwargs).logits[0]
    alone = separate_logits(model, row.input_ids, lengths)
    assert (logits[lengths[0]:sum(lengths)] - torch.cat(alone[1:])).abs().max() > 1e-3


class Wrapper(torch.nn.Module):
    """A wrapper (as a LoRA or schedule wrapper would be) that forwards keywords."""

    def __init__(self, inner: torch.nn.Module, kwargs: bool) -> None:
        super().__init__()
        self.inner = inner
        self.forward = self.keywords if kwargs else self.ids_only  # type: ignore[method-assign]

    def keywords(self, **kwargs: Any) -> Any:
        return self.inner(**kwargs)

    def ids_only(self, input_ids: torch.Tensor) -> Any:
        return self.inner(input_ids=input_ids)


def test_check_packing_accepts_and_refuses():
    for kind in ("llama", "qwen2"):
        for attn in ("sdpa", "eager"):
            C.check_packing(tiny(kind, attn))
    C.check_packing(Wrapper(tiny("llama", "sdpa"), kwargs=True))
    with pytest.raises(DataError, match=r"; Wrapper\.forward takes no position_ids"):
        C.check_packing(Wrapper(tiny("llama", "sdpa"), kwargs=False))
    with pytest.raises(DataError, match=r"; Linear is not a transformers model \(no "
                       r"PreTrainedModel inside\)"):
        C.check_packing(torch.nn.Linear(2, 2))
    model = tiny("llama", "sdpa")
    model.config._attn_implementation = "my_kernel"
    with pytest.raises(DataError, match=r"its attention implementation 'my_kernel' is not "
                       r"one transformers builds masks for \(eager, "):
        C.check_packing(model)


# --------------------------------------------------------------------------- batches


def test_example_batch_is_deterministic_and_walks_every_row(tmp_path):
    lines = [{"prompt": f"p{i:02d}", "response": "r" * (1 + i % 3)} for i in range(10)]
    corpus = C.load_examples([write(tmp_path / "d.jsonl", *lines)], None, seq_len=16)

    def batch(step: int, seed: int = 5) -> dict[str, torch.Tensor]:
        return C.example_batch(corpus, step=step, batch_size=3, seq_len=16, seed=seed)

    def names(step: int, seed: int = 5) -> list[str]:
        return [bytes(r[:3].tolist()).decode() for r in batch(step, seed)["input_ids"]]

    first = batch(2)
    assert all(v.dtype == torch.int64 and v.shape == (3, 16) for v in first.values())
    assert all(torch.equal(first[k], batch(2)[k]) for k in first)
    seen = names(1) + names(2) + names(3) + names(4)[:1]      # the first epoch: 10 rows
    assert sorted(seen) == [f"p{i:02d}" for i in range(10)]
    assert names(1) != names(1, seed=6) or names(2) != names(2, seed=6)
    for row, pos in zip(first["input_ids"], first["position_ids"]):
        n = int((row != corpus.pad_id).sum())
        assert pos.tolist() == list(range(16))
        assert row[n:].eq(0).all() and n >= 4
    with pytest.raises(DataError, match=r"seq_len is shorter than a row of the corpus"):
        C.example_batch(corpus, step=1, batch_size=2, seq_len=4, seed=0)
    with pytest.raises(DataError, match=r"step and batch_size must be at least 1"):
        C.example_batch(corpus, step=0, batch_size=2, seq_len=16, seed=0)


# --------------------------------------------------------------------------- bad input


def test_which_paths_are_examples(tmp_path):
    a = write(tmp_path / "a.jsonl", {"prompt": "a", "response": "b"})
    (tmp_path / "t.txt").write_text("text")
    assert C.is_example_data([a, str(tmp_path / "B.JSONL")])
    assert not C.is_example_data([str(tmp_path / "t.txt")])
    assert not C.is_example_data([str(tmp_path)])                 # a folder
    assert not C.is_example_data([])
    assert C.is_example_data(a)                                   # one path, not a list
    with pytest.raises(DataError, match=r"--data mixes \.jsonl example files with other data"
                       r"(.|\n)*values: jsonl=\['.*a\.jsonl'\], other=\['.*t\.txt'\]"):
        C.is_example_data([a, str(tmp_path / "t.txt")])
    with pytest.raises(DataError, match=r"load_examples reads \.jsonl files only"):
        C.load_examples([str(tmp_path / "t.txt")], None, seq_len=8)
    with pytest.raises(DataError, match=r"no such file or folder"):
        C.load_examples([str(tmp_path / "missing.jsonl")], None, seq_len=8)
    with pytest.raises(DataError, match=r"seq_len must be at least 2"):
        C.load_examples([a], None, seq_len=1)


GOOD = {"prompt": "a", "response": "b"}
USER = {"role": "user", "content": "hi"}
ASSISTANT = {"role": "assistant", "content": "hello"}

BAD_LINES = [
    ([GOOD, GOOD, '{"prompt": "a", '],
     r"line 3: not valid JSON: Expecting property name enclosed in double quotes "
     r"\(column 17\)"),
    (["", "   ", "{bad"], r"line 3: not valid JSON"),                       # blanks count
    (["[1, 2]"], r"line 1: a line must be a JSON object; this one is an array"),
    (["[" * 100_000 + "]" * 100_000], r"line 1: not valid JSON: RecursionError"),
    (['{"prompt": 1' + "0" * 5000 + "}"], r"line 1: not valid JSON: ValueError: Exceeds"),
    ([GOOD, {"prompt": "a"}], r'line 2: "response" is missing'),
    ([{"response": "b"}], r'line 1: "prompt" is missing'),
    ([{"prompt": "a", "response": 4}], r'line 1: "response" must be a string, not a number'),
    ([{"prompt": "a", "response": " \n"}], r'line 1: "response" is empty'),
    ([{"text": "a"}], r'line 1: the object has neither "messages" nor "prompt" and "response"'),
    ([{"messages": [USER, ASSISTANT], "prompt": "a"}],
     r'line 1: the object has both "messages" and "prompt"/"response"'),
    ([{"messages": "hi"}], r'line 1: "messages" must be an array, not a string'),
    ([{"messages": []}], r'line 1: "messages" is empty'),
    ([{"messages": [USER, "hello"]}], r"line 1: message 2 must be an object, not a string"),
    ([{"messages": [{"content": "hi"}, ASSISTANT]}],
     r'line 1: message 1 needs a "role" \(a non-empty string'),
    ([{"messages": [USER, {"role": "assistant", "content": None}]}],
     r'line 1: message 2 \(assistant\) needs a "content" string, not null'),
    ([{"messages": [USER, {"role": "assistant", "content": "x", "tool_calls": []}]}],
     r"line 1: message 2 has keys other than \"role\" and \"content\": 'tool_calls'"),
    ([{"messages": [USER, {"role": "assistant", "content": ""}]}],
     r"line 1: message 2 \(assistant\) is empty"),
    ([GOOD, {"messages": [{"role": "system", "content": "s"}, USER]}],
     r'line 2: no message has the role "assistant": nothing would count in the loss'),
]


@pytest.mark.parametrize("lines, problem", BAD_LINES)
def test_bad_lines_name_the_file_and_line(lines, problem, tmp_path):
    path = write(tmp_path / "bad.jsonl", *lines)
    with pytest.raises(DataError) as info:
        C.load_examples([path], None, seq_len=64)
    pinned = r"^torchloom train\(\.\.\.\): " + re.escape(path) + ", " + problem
    assert re.search(pinned, str(info.value)), str(info.value)
    assert info.value.values["file"] == path and info.value.fix


def test_bad_bytes_and_long_lines(tmp_path, monkeypatch):
    path = tmp_path / "bytes.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n" + b'{"prompt": "\xff"}\n')
    with pytest.raises(DataError, match=r"bytes\.jsonl, line 2: not UTF-8 text \(byte 13 of "
                       r"the line\)(.|\n)*fix: save the file as UTF-8"):
        C.load_examples([str(path)], None, seq_len=64)
    monkeypatch.setattr(C, "MAX_LINE_BYTES", 40)
    long = write(tmp_path / "long.jsonl", GOOD, {"prompt": "a" * 40, "response": "b"})
    with pytest.raises(DataError, match=r"long\.jsonl, line 2: the line is longer than 40 "
                       r"bytes"):
        C.load_examples([long], None, seq_len=64)
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + json.dumps(GOOD).encode() + b"\r\n")
    assert C.load_examples([str(bom)], None, seq_len=64).examples == 1


def test_template_problems_name_the_line(folders, tmp_path):
    path = write(tmp_path / "c.jsonl", GOOD, {"messages": [USER, ASSISTANT]})
    with pytest.raises(DataError, match=r"c\.jsonl, line 2: \"messages\" need a chat "
                       r"template, and the tokenizer of .*plain has none(.|\n)*fix: write the "
                       r"examples as \{\"prompt\": \.\.\., \"response\": \.\.\.\} lines"):
        C.load_examples([path], folders["plain"], seq_len=64)
    with pytest.raises(DataError, match=r"c\.jsonl, line 2: the chat template of .*last "
                       r"breaks the prefix property at message 2 \(assistant\)"):
        C.load_examples([path], folders["last"], seq_len=64)
    tool = write(tmp_path / "tool.jsonl", GOOD, GOOD, {"messages": [
        USER, {"role": "tool", "content": "42"}, ASSISTANT]})
    with pytest.raises(DataError, match=r"tool\.jsonl, line 3: the chat template of .*strict "
                       r"fails on this conversation: TemplateError: unknown role tool"
                       r"(.|\n)*values: .*roles=\['user', 'tool', 'assistant'\]"):
        C.load_examples([tool], folders["strict"], seq_len=64)
    first = write(tmp_path / "f.jsonl", {"messages": [ASSISTANT, USER, ASSISTANT]})
    with pytest.raises(DataError, match=r"f\.jsonl, line 1: the conversation starts with an "
                       r"assistant message"):
        C.load_examples([first], folders["chatml"], seq_len=64)
    # bytes take an assistant-first conversation as it is
    assert C.load_examples([first], None, seq_len=64).response_tokens == 12
