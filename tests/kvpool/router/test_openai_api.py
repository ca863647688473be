"""OpenAI request validation and the stop-string matcher (pure parts of the router's front)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.router import openai_api as oa


def test_chat_request_validation():
    ok = oa.parse(oa.ChatRequest, {"model": "m", "messages": [{"role": "user", "content": "hi"}], "extra": 1})
    assert ok.chat() == [{"role": "user", "content": "hi"}] and ok.token_budget() is None
    parts = oa.parse(oa.ChatRequest, {"model": "m", "max_completion_tokens": 5, "max_tokens": 9,
                                      "messages": [{"role": "developer", "content": [{"type": "text", "text": "a"},
                                                                                     {"type": "text", "text": "b"}]}]})
    assert parts.chat() == [{"role": "system", "content": "ab"}] and parts.token_budget() == 5
    for body, param in [({"model": "m", "messages": []}, "messages"),
                        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
                        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
                        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 3}, "temperature"),
                        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "top_p": 0}, "top_p"),
                        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": ["a"] * 5}, "stop"),
                        ({"messages": [{"role": "user", "content": "x"}]}, "model"),
                        ({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role")]:
        with pytest.raises(oa.OpenAIError) as info:
            oa.parse(oa.ChatRequest, body)
        assert info.value.http_status == 400 and info.value.param == param, body
        assert info.value.body()["error"]["type"] == "invalid_request_error"
    with pytest.raises(oa.OpenAIError):
        oa.parse(oa.ChatRequest, [1, 2])


def test_completion_request_validation():
    assert oa.parse(oa.CompletionRequest, {"model": "m", "prompt": ["one"]}).prompt == "one"
    assert oa.parse(oa.CompletionRequest, {"model": "m", "prompt": [1, 2, 3]}).prompt == [1, 2, 3]
    for body in ({"model": "m", "prompt": ["a", "b"]}, {"model": "m", "prompt": []},
                 {"model": "m", "prompt": "x", "echo": True}, {"model": "m", "prompt": "x", "logprobs": 2}):
        with pytest.raises(oa.OpenAIError):
            oa.parse(oa.CompletionRequest, body)


def test_stop_matcher_cuts_and_holds_back():
    m = oa.StopMatcher(["END", "\n\n"])
    sent = m.push("Hello E") + m.push("N") + m.push("D and more")
    assert sent == "Hello " and m.hit
    m = oa.StopMatcher(["END"])
    assert m.push("Hello E") == "Hello "  # "E" might start END: held back
    assert m.push("x") == "Ex" and not m.hit
    assert m.flush() == ""
    m = oa.StopMatcher(["stop"])
    assert m.push("no st") == "no " and m.flush() == "st"
    assert oa.StopMatcher(None).push("abc") == "abc"


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="abc\n ", max_size=40), stops=st.lists(st.text(alphabet="abc\n", min_size=1, max_size=3),
                                                                   min_size=1, max_size=4),
       cuts=st.lists(st.integers(0, 40), max_size=8))
def test_stop_matcher_equals_cutting_the_whole_text(text, stops, cuts):
    """Streaming through the matcher in any pieces gives the whole text cut at the first stop to
    complete (as an engine checks its text while generating it: of overlapping stops, the one that
    ends first wins, then the one that starts first)."""
    bounds = sorted({0, len(text), *[c for c in cuts if c <= len(text)]})
    m = oa.StopMatcher(stops)
    out = ""
    for a, b in zip(bounds, bounds[1:]):
        out += m.push(text[a:b])
        if m.hit:
            break
    out += m.flush()
    found = [(i + len(s), i) for s, i in ((s, text.find(s)) for s in stops) if i >= 0]
    assert out == (text[:min(found)[1]] if found else text)
