#!/usr/bin/env python3
"""Renders test conversations with Hugging Face transformers: the reference that
tests/chat_templates.rs checks tensorfold's chat template rendering (minijinja) against.

For each template below and each conversation of CASES, writes to tests/data/chat_templates.json
the text of `tokenizer.apply_chat_template(messages, tools=..., add_generation_prompt=...,
tokenize=False, **kwargs)` and its token ids (`tokenize=True`), or the exception it raised
(the Rust side must fail too, with the same message when the template raised it itself).

The tokenizer is the vocab fixture's (the real Qwen3.5 tokenizer). Templates:
- the vocab fixture's own chat_template.jinja (plain ChatML: many cases fail, on both sides);
- tests/data/qwen35_style.jinja, a template in Qwen3.5's format written for the test, which uses
  the Jinja features of Qwen3.5's own template (the fixtures do not ship that one);
- with --template PATH (repeatable), any other file, e.g. a model's real chat_template.jinja;
  write those to another --out file and point TENSORFOLD_CHAT_TEMPLATE_CASES at it.

Run from the repository root (needs `pip install transformers jinja2`; no torch):
    python3 tools/chat_template_cases.py
"""

import argparse
import hashlib
import json
import pathlib

import jinja2
import transformers
from transformers import AutoTokenizer

ROOT = pathlib.Path(__file__).resolve().parent.parent
VOCAB = "../shared/fixtures/vocab/mlx-q4"
TEMPLATES = [
    f"{VOCAB}/chat_template.jinja",
    "tests/data/qwen35_style.jinja",
]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather <now> & later – \"any\" city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "Name, e.g. 'Tōkyō'"},
                "days": {"type": "integer", "minimum": 1, "maximum": 16},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "ratio": {"type": "number", "default": 1.0, "multipleOf": 1e-06},
            },
            "required": ["city"],
        },
    },
}
SHELL = {
    "type": "function",
    "function": {
        "name": "shell",
        "description": "Run a command",
        "parameters": {
            "type": "object",
            "properties": {
                "cmd": {"type": "array", "items": {"type": "string"}},
                "env": {"type": "object", "additionalProperties": {"type": "string"}},
                "timeout": {"type": ["integer", "null"]},
            },
        },
    },
}
NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}


def call(name, arguments, call_id=None, wrapped=True):
    fn = {"name": name, "arguments": arguments}
    if not wrapped:
        return fn
    c = {"type": "function", "function": fn}
    if call_id:
        c["id"] = call_id
    return c


def user(text):
    return {"role": "user", "content": text}


def assistant(text, **extra):
    return {"role": "assistant", "content": text, **extra}


def tool(text, call_id=None):
    m = {"role": "tool", "content": text}
    if call_id:
        m["tool_call_id"] = call_id
    return m


SYSTEM = {"role": "system", "content": "You are a helpful assistant."}

# (name, messages, tools, add_generation_prompt, template kwargs)
CASES = [
    ("one user turn", [user("Hello!")], None, True, {}),
    ("thinking on", [user("Hello!")], None, True, {"enable_thinking": True}),
    ("thinking off", [user("Hello!")], None, True, {"enable_thinking": False}),
    ("system and user", [SYSTEM, user("What is 2+2?")], None, True, {}),
    ("system padded with whitespace", [{"role": "system", "content": "\n  Be brief.  \n\n"}, user("  Hi  \n")], None, True, {}),
    ("multi-turn", [SYSTEM, user("Hi"), assistant("Hello! How can I help?"), user("Tell me a joke.")], None, True, {}),
    ("ends with the assistant, no generation prompt", [user("Hi"), assistant("Hello.")], None, False, {}),
    ("think block in history before the last query",
     [user("2+2?"), assistant("<think>\nAdd them.\n</think>\n\n4"), user("And 3+3?")], None, True, {"enable_thinking": True}),
    ("reasoning_content before the last query is dropped",
     [user("2+2?"), assistant("4", reasoning_content="Add them."), user("3+3?")], None, True, {}),
    ("reasoning_content after the last query is kept",
     [user("Weather in Oslo?"), assistant("", reasoning_content="\nCall the tool.\n", tool_calls=[call("get_weather", {"city": "Oslo"}, "c1")]),
      tool("rain", "c1")], [WEATHER], True, {"enable_thinking": True}),
    ("think block inline after the last query",
     [user("Weather?"), assistant("<think>\nLook it up.\n</think>\n\nChecking.", tool_calls=[call("get_weather", {"city": "Rome"})]), tool("sun")],
     [WEATHER], True, {}),
    ("tools without a system message", [user("Weather in Paris?")], [WEATHER], True, {}),
    ("tools with a system message", [SYSTEM, user("Weather in Paris?")], [WEATHER, SHELL], True, {}),
    ("tools with an empty system message", [{"role": "system", "content": ""}, user("Hi")], [NOW], True, {}),
    ("typed arguments",
     [user("Run it"), assistant("", tool_calls=[call("shell", {"cmd": ["ls", "-la", "dir with space"], "env": {"A": "1", "B": "ü"},
                                                             "timeout": None, "verbose": True, "quiet": False, "retries": 3,
                                                             "ratio": 0.25, "big": 1e16, "whole": 2.0, "neg": -0.0})]),
      tool("ok")], [SHELL], True, {}),
    ("text before a call", [user("Weather?"), assistant("Let me check.", tool_calls=[call("get_weather", {"city": "Lima", "days": 2})]), tool("{\"temp\": 18}")],
     [WEATHER], True, {}),
    ("two calls in one message",
     [user("Both?"), assistant("", tool_calls=[call("get_weather", {"city": "A"}, "c1"), call("now", {}, "c2")]), tool("a", "c1"), tool("b", "c2")],
     [WEATHER, NOW], True, {}),
    ("three consecutive tool results",
     [user("Go"), assistant("", tool_calls=[call("now", {}), call("now", {}), call("now", {})]), tool("1"), tool("2"), tool("3")],
     [NOW], True, {}),
    ("tool results then a new question",
     [user("Time?"), assistant("", tool_calls=[call("now", {})]), tool("12:00"), assistant("It is noon."), user("Thanks. And tomorrow?")],
     [NOW], True, {"enable_thinking": True}),
    ("zero-argument call", [user("Time?"), assistant(None, tool_calls=[call("now", {})])], [NOW], False, {}),
    ("call without the function wrapper", [user("Time?"), assistant("", tool_calls=[call("now", {"tz": "UTC"}, wrapped=False)]), tool("noon")],
     [NOW], True, {}),
    ("content as text parts",
     [{"role": "system", "content": [{"type": "text", "text": "Sys "}, {"type": "text", "text": "prompt"}]},
      {"role": "user", "content": [{"type": "text", "text": "Part one, "}, {"type": "text", "text": "part two."}]}], None, True, {}),
    ("unicode text", [user("Grüße – 你好 😀 e\u0301 \u00e9 \U0001f469\u200d\U0001f4bb tab\tend")], None, True, {}),
    ("multi-step agent keeps both reasoning turns",
     [SYSTEM, user("Plan a trip"), assistant("", reasoning_content="Need weather.", tool_calls=[call("get_weather", {"city": "Nice", "days": 3})]),
      tool("sunny"), assistant("", reasoning_content="Need time.", tool_calls=[call("now", {})]), tool("09:00")],
     [WEATHER, NOW], True, {"enable_thinking": True}),
    ("reasoning history with thinking off",
     [user("Q"), assistant("", reasoning_content="R", tool_calls=[call("now", {})]), tool("t")], [NOW], True, {"enable_thinking": False}),
    ("empty and whitespace contents", [user("   "), assistant(""), user("\n")], None, True, {}),
    ("string argument that looks like JSON",
     [user("Write"), assistant("", tool_calls=[call("shell", {"cmd": "{\"a\": 1}\nsecond line\n", "note": "[1, 2]"})]), tool("done")],
     [SHELL], True, {}),
    ("a user turn that looks like a tool response is not a query",
     [user("Go"), assistant("", tool_calls=[call("now", {})]), user("<tool_response>\n12\n</tool_response>")], [NOW], True, {}),
    ("no user query at all", [user("<tool_response>x</tool_response>")], None, True, {}),
    ("system message not first", [user("Hi"), {"role": "system", "content": "late"}], None, True, {}),
    ("unknown role", [user("Hi"), {"role": "critic", "content": "meh"}], None, True, {}),
    ("image content part", [{"role": "user", "content": [{"type": "text", "text": "Look: "}, {"type": "image_url", "image_url": {"url": "x"}}]}],
     None, True, {}),
]


def render(tok, template, messages, tools, agp, kwargs):
    """Text and ids of one case, or the exception (type, message)."""
    args = dict(tools=tools, add_generation_prompt=agp, chat_template=template, **kwargs)
    try:
        text = tok.apply_chat_template(messages, tokenize=False, **args)
        ids = tok.apply_chat_template(messages, tokenize=True, return_dict=True, **args)["input_ids"]
    except jinja2.exceptions.TemplateError as e:
        # raise_exception() raises TemplateError itself; Jinja's own failures are subclasses.
        raised = type(e) is jinja2.exceptions.TemplateError
        return {"error": {"raised": raised, "message": str(e)}}
    except (TypeError, ValueError) as e:
        return {"error": {"raised": False, "message": f"{type(e).__name__}: {e}"}}
    assert ids == tok.encode(text, add_special_tokens=False)
    return {"text": text, "ids": ids}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--template", action="append", help="a template file (replaces the default list)")
    ap.add_argument("--out", default="tests/data/chat_templates.json")
    opts = ap.parse_args()

    tok = AutoTokenizer.from_pretrained(ROOT / VOCAB)
    templates = []
    for path in opts.template or TEMPLATES:
        source = (ROOT / path).read_text(encoding="utf-8") if not pathlib.Path(path).is_absolute() else pathlib.Path(path).read_text(encoding="utf-8")
        cases = []
        for name, messages, tools, agp, kwargs in CASES:
            case = {"name": name, "messages": messages, "add_generation_prompt": agp, "kwargs": kwargs}
            if tools is not None:
                case["tools"] = tools
            case.update(render(tok, source, messages, tools, agp, kwargs))
            cases.append(case)
        templates.append({
            "path": path,
            "sha256": hashlib.sha256(source.encode("utf-8")).hexdigest(),
            "cases": cases,
        })
    out = {
        "generator": "tools/chat_template_cases.py",
        "transformers": transformers.__version__,
        "jinja2": jinja2.__version__,
        "tokenizer": VOCAB,
        "templates": templates,
    }
    (ROOT / opts.out).write_text(json.dumps(out, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    for t in templates:
        failed = sum("error" in c for c in t["cases"])
        print(f"{t['path']}: {len(t['cases'])} cases, {failed} raise")


if __name__ == "__main__":
    main()
