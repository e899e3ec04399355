"""Chat templates without a system role (Gemma 2's raises on one): the system text opens the first user turn."""

from __future__ import annotations

import copy
import random

import pytest
from jinja2 import TemplateError
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from pagedq.pipeline.preprocess import fold_system, render_prompt
from pagedq.pipeline.protocol import ChatCompletionRequest

# Gemma 2's template in the part that matters: a system message raises; turns as <start_of_turn>role ... .
NO_SYSTEM = (
    "{{ bos_token }} {% for m in messages %}{% if m['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "<start_of_turn> {{ role }} {{ m['content'] }} <end_of_turn> {% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn> model {% endif %}")


def tokenizer(template: str) -> PreTrainedTokenizerFast:
    words = "<bos> <start_of_turn> <end_of_turn> user model system".split()
    words += [f"w{i}" for i in range(50)] + ["<unk>"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", unk_token="<unk>", chat_template=template)


def words(n: int) -> str:
    return " ".join(f"w{random.randrange(50)}" for _ in range(n))


def test_a_system_message_opens_the_first_user_turn_when_the_template_has_no_system_role():
    tok = tokenizer(NO_SYSTEM)
    system, user, answer, again = words(5), words(7), words(3), words(4)
    req = ChatCompletionRequest(model="m", messages=[
        {"role": "system", "content": system}, {"role": "user", "content": user},
        {"role": "assistant", "content": answer}, {"role": "user", "content": again}])
    with pytest.raises(TemplateError):  # the template itself refuses the system role
        tok.apply_chat_template([m.model_dump() for m in req.messages], tokenize=False)
    ids = render_prompt(tok, req)
    turns = [("user", f"{system} {user}"), ("model", answer), ("user", again)]
    want = ["<bos>"] + [w for role, text in turns for w in ["<start_of_turn>", role, *text.split(), "<end_of_turn>"]]
    assert tok.convert_ids_to_tokens(ids) == want + ["<start_of_turn>", "model"]


def test_fold_system_without_a_user_message_makes_one():
    messages = [{"role": "system", "content": "a"}, {"role": "system", "content": "b"},
                {"role": "assistant", "content": "c"}]
    assert fold_system(messages) == [{"role": "user", "content": "a\n\nb"}, {"role": "assistant", "content": "c"}]


def test_fold_system_leaves_the_request_messages_alone():
    system, user = words(4), words(6)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    before = copy.deepcopy(messages)
    assert fold_system(messages) == [{"role": "user", "content": f"{system}\n\n{user}"}]
    assert messages == before  # the user turn that opens with the system text is a copy


def test_a_template_error_without_a_system_message_is_not_hidden():
    tok = tokenizer("{{ raise_exception('broken template') }}")
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": words(3)}])
    with pytest.raises(TemplateError, match="broken template"):
        render_prompt(tok, req)
