"""``serve --tokenizer PATH``: a local Hugging Face tokenizer routes text like the engine caches it.

The test builds a word-level ``tokenizer.json`` (with the ``tokenizers``
library, nothing downloaded) whose vocabulary gives numbered words the ids
engine-sim gives them: the router then hashes exactly the engine's tokens
without asking its ``/tokenize``, so the truth loop finds prediction and
reported reuse equal. (Chat rendering with a local template is covered by
the unit tests: engine-sim's template words hash to ids near 2**31, which a
word-level vocabulary cannot hold cheaply.)
"""

from __future__ import annotations

import json
from pathlib import Path

from support import wait_until
from support.engine_sim import words
from support.gateway import Gateway

from tokenspeed_router.engine_sim.tokenizer import SimTokenizer

TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def _engine_like_tokenizer(folder: Path, vocab_words: list[str]) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    sim = SimTokenizer()
    vocab = {w: sim.word_id(w) for w in vocab_words}
    vocab["<unk>"] = 5
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    return folder


def test_local_tokenizer_predicts_what_the_engine_reuses(tmp_path: Path) -> None:
    path = _engine_like_tokenizer(tmp_path, [str(i) for i in range(1000, 1200)])
    with Gateway(tmp_path, [["--instant"], ["--instant"]], serve_args=["--tokenizer", str(path)]) as gw:
        prompt = words(1000, 70)
        worker, _ = gw.complete(prompt)
        wait_until(lambda: gw.held_blocks(list(range(1000, 1070))).get(worker) == 4, 20, interval_s=0.02,
                   what="the engine's events")
        again, answer = gw.complete(prompt)
        assert again == worker and answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
        truth = gw.workers()[worker]["truth"]
        assert truth["predicted_cached_tokens"] == truth["reported_cached_tokens"] == 64
        # chat through the local template: rendered, tokenized here, answered by the engine
        chat = gw.post("/v1/chat/completions", {"messages": [{"role": "user", "content": words(1100, 40)}],
                                                 "max_tokens": 2})
        assert chat.status_code == 200, chat.text
        assert not any(w["misaligned"] for w in gw.workers().values())
        assert gw.metric("tokenspeed_gateway_tokenize_failures_total") == 0
