"""The agent-facing APIs of `tensorfold serve`, driven by the official clients (run by
tests/serve.rs): OpenAI's Responses API and chat reasoning through the `openai` package, and
Anthropic's Messages API through the `anthropic` package.

The server runs the vocab fixture (random weights, Qwen3.5's tokenizer) with a chat template in
Qwen3.5's format (tests/data/qwen35_style.jinja), so `enable_thinking` opens a `<think>` block
at the end of the prompt and everything the model writes is reasoning until it closes it.

Environment: TF_BASE (http://127.0.0.1:PORT of the server under test).
"""

import json
import os
import sys
import unittest
import urllib.error
import urllib.request

import anthropic
import openai

BASE = os.environ.get("TF_BASE", "http://127.0.0.1:8080")
MODEL = "qwen35-style"
USER = [{"role": "user", "content": "Say something about rivers."}]
THINK = {"chat_template_kwargs": {"enable_thinking": True}}
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}]


def oai():
    return openai.OpenAI(base_url=BASE + "/v1", api_key="unused", max_retries=0, timeout=120)


def claude():
    return anthropic.Anthropic(base_url=BASE, api_key="unused", max_retries=0, timeout=120)


def raw(path, body):
    req = urllib.request.Request(BASE + path, data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


class Chat(unittest.TestCase):
    def test_thinking_output_is_reasoning_not_content(self):
        kw = dict(model=MODEL, messages=USER, max_tokens=8, temperature=1.0, seed=11, extra_body={"ignore_eos": True, **THINK})
        r = oai().chat.completions.create(**kw)
        m = r.choices[0].message
        reasoning = m.model_extra.get("reasoning_content")
        self.assertTrue(reasoning, m)
        self.assertEqual(m.model_extra.get("reasoning"), reasoning)
        self.assertFalse(m.content)
        # Streamed: the same reasoning in deltas, no content.
        got, content = "", ""
        for chunk in oai().chat.completions.create(stream=True, **kw):
            for c in chunk.choices:
                got += (c.delta.model_extra or {}).get("reasoning_content") or ""
                content += c.delta.content or ""
        self.assertEqual((got, content), (reasoning, ""))

    def test_without_thinking_output_is_content(self):
        r = oai().chat.completions.create(model=MODEL, messages=USER, max_tokens=6, temperature=0, extra_body={"ignore_eos": True, **NO_THINK})
        m = r.choices[0].message
        self.assertTrue(m.content)
        self.assertIsNone(m.model_extra.get("reasoning_content"))

    def test_reasoning_effort_switches_thinking_and_template_kwargs_win(self):
        kw = dict(model=MODEL, messages=USER, max_tokens=4, temperature=0)
        low = oai().chat.completions.create(reasoning_effort="low", extra_body={"ignore_eos": True}, **kw).choices[0].message
        self.assertTrue(low.model_extra.get("reasoning_content"), low)
        self.assertFalse(low.content)
        off = oai().chat.completions.create(reasoning_effort="none", extra_body={"ignore_eos": True}, **kw)
        self.assertTrue(off.choices[0].message.content)
        self.assertIsNone(off.choices[0].message.model_extra.get("reasoning_content"))
        # chat_template_kwargs.enable_thinking wins over the effort: the same prompt as "none".
        kwargs_off = oai().chat.completions.create(reasoning_effort="high", extra_body={"ignore_eos": True, **NO_THINK}, **kw)
        self.assertEqual(kwargs_off.choices[0].message.content, off.choices[0].message.content)
        self.assertEqual(kwargs_off.usage.prompt_tokens, off.usage.prompt_tokens)
        with self.assertRaises(openai.BadRequestError) as e:
            oai().chat.completions.create(reasoning_effort="extreme", **kw)
        self.assertEqual((e.exception.body["param"], e.exception.body["code"]), ("reasoning_effort", "invalid_value"))
        self.assertIn('"max"', e.exception.body["message"])

    def test_tools_and_tool_history_render_and_count_alike(self):
        history = USER + [
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": "Oslo", "days": 2})}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "rain"},
        ]
        r = oai().chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=2, extra_body=NO_THINK)
        status, tok = raw("/tokenize", {"messages": history, "tools": TOOLS, **NO_THINK})
        self.assertEqual(status, 200)
        self.assertEqual(r.usage.prompt_tokens, tok["count"])
        status, plain = raw("/tokenize", {"messages": history, **NO_THINK})
        self.assertGreater(tok["count"], plain["count"])
        # The decoded arguments reach the template: the rendered history holds them.
        status, text = raw("/detokenize", {"tokens": tok["tokens"]})
        self.assertIn("<parameter=city>\nOslo\n</parameter>", text["prompt"])
        self.assertIn("get_weather", text["prompt"])

    def test_bad_tool_arguments_name_the_field(self):
        history = USER + [{"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{not json"}}]}]
        with self.assertRaises(openai.BadRequestError) as e:
            oai().chat.completions.create(model=MODEL, messages=history, max_tokens=2)
        self.assertEqual(e.exception.body["param"], "messages[1].tool_calls[0].function.arguments")

# Constrained decoding: random weights write garbage unless constrained, so every string the
# schemas allow is bounded (maxLength, enum) and the outputs end on their own (EOS).
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "word": {"type": "string", "maxLength": 6}}, "required": ["n", "word"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA, "strict": True}}
WEATHER = {"type": "object", "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 9}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["days", "unit"]}
CLOCK = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}, "seconds": {"type": "boolean"}}, "required": ["zone"]}
FORCED_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}, {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}}]


def streamed_content(**kw):
    """A streamed chat completion's content and finish reason (choice 0's, the only one)."""
    streamed, finish = "", None
    for chunk in oai().chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            streamed += c.delta.content or ""
            finish = c.finish_reason or finish
    return streamed, finish


def check_schema(test, text):
    """`text` is JSON of SCHEMA (no validator package: the schema is small)."""
    value = json.loads(text)
    test.assertEqual(set(value), {"n", "word"}, text)
    test.assertIsInstance(value["n"], int)
    test.assertTrue(0 <= value["n"] <= 99, text)
    test.assertIsInstance(value["word"], str)
    test.assertLessEqual(len(value["word"]), 6, text)


def check_call(test, name, arguments):
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    if name == "get_weather":
        test.assertEqual(set(args), {"days", "unit"}, args)
        test.assertIsInstance(args["days"], int)
        test.assertTrue(1 <= args["days"] <= 9, args)
        test.assertIn(args["unit"], ("celsius", "fahrenheit"))
    else:
        test.assertEqual(name, "get_time")
        test.assertIn(args["zone"], ("UTC", "CET"))
        test.assertLessEqual(set(args), {"zone", "seconds"})
        if "seconds" in args:
            test.assertIsInstance(args["seconds"], bool)


class Constrained(unittest.TestCase):
    def test_json_schema_output_parses_and_validates_whole_and_streamed(self):
        kw = dict(model=MODEL, messages=USER, max_tokens=60, temperature=1.0, seed=5, response_format=FORMAT, extra_body=NO_THINK)
        r = oai().chat.completions.create(n=2, **kw)
        for c in r.choices:
            self.assertEqual(c.finish_reason, "stop", c)
            check_schema(self, c.message.content)
        self.assertEqual(streamed_content(**kw), (r.choices[0].message.content, "stop"))

    def test_ignore_eos_still_ends_where_the_grammar_does(self):
        # The constraint wins: once its output is complete only EOS is allowed, which ends the
        # turn even with ignore_eos (it was a 500 after the valid output).
        kw = dict(model=MODEL, messages=USER, max_tokens=60, temperature=1.0, seed=5, response_format=FORMAT, extra_body={"ignore_eos": True, **NO_THINK})
        r = oai().chat.completions.create(**kw)
        self.assertEqual(r.choices[0].finish_reason, "stop", r.choices[0])
        check_schema(self, r.choices[0].message.content)
        self.assertEqual(streamed_content(**kw), (r.choices[0].message.content, "stop"))
        r = oai().chat.completions.create(model=MODEL, messages=USER, tools=FORCED_TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=120, temperature=1.0, seed=2, extra_body={"ignore_eos": True, **NO_THINK})
        c = r.choices[0]
        self.assertEqual(c.finish_reason, "tool_calls")
        check_call(self, c.message.tool_calls[0].function.name, c.message.tool_calls[0].function.arguments)

    def test_forced_call_parameters_with_refs_are_enforced(self):
        # A `$ref`'d object (itself holding a `$ref`) is JSON of its schema, not free text.
        params = {
            "type": "object",
            "$defs": {
                "Stay": {"type": "object", "properties": {"nights": {"type": "integer", "minimum": 1, "maximum": 9}, "unit": {"$ref": "#/$defs/Unit"}}, "required": ["nights", "unit"], "additionalProperties": False},
                "Unit": {"type": "string", "enum": ["room", "suite"]},
            },
            "properties": {"stay": {"$ref": "#/$defs/Stay"}},
            "required": ["stay"],
        }
        tools = [{"type": "function", "function": {"name": "book", "parameters": params}}]
        r = oai().chat.completions.create(model=MODEL, messages=USER, tools=tools, tool_choice="required", parallel_tool_calls=False, max_tokens=80, temperature=1.0, seed=3, extra_body=NO_THINK)
        c = r.choices[0]
        self.assertEqual(c.finish_reason, "tool_calls", c)
        args = json.loads(c.message.tool_calls[0].function.arguments)
        self.assertEqual(set(args), {"stay"}, args)
        self.assertEqual(set(args["stay"]), {"nights", "unit"}, args)
        self.assertTrue(1 <= args["stay"]["nights"] <= 9, args)
        self.assertIn(args["stay"]["unit"], ("room", "suite"))
        # Bounds that allow no string are refused, naming the keyword in the request.
        bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"code": {"type": "string", "minLength": 4, "maxLength": 2}}}}}]
        with self.assertRaises(openai.BadRequestError) as e:
            oai().chat.completions.create(model=MODEL, messages=USER, tools=bad, tool_choice="required", max_tokens=2)
        self.assertEqual(e.exception.body["param"], "tools[0].function.parameters.properties.code.minLength")
        self.assertEqual(e.exception.body["code"], "invalid_function_parameters")
        self.assertIn("greater than `maxLength` 2", e.exception.body["message"])
        # So are bounds no value of the parameter's format meets (a uuid is 36 characters).
        uuid = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"id": {"type": "string", "format": "uuid", "maxLength": 10}}}}}]
        with self.assertRaises(openai.BadRequestError) as e:
            oai().chat.completions.create(model=MODEL, messages=USER, tools=uuid, tool_choice="required", max_tokens=2)
        self.assertEqual(e.exception.body["param"], "tools[0].function.parameters.properties.id.maxLength")
        self.assertIn("a `uuid` is 36 characters; `maxLength` 10 leaves none", e.exception.body["message"])

    def test_a_cut_parallel_call_reads_alike_on_chat_and_responses(self):
        # This seed writes two calls; max_tokens cuts them around the end of the first, inside
        # the second's header and inside its value. Chat and Responses report the same calls
        # (a call cut before its name is whole is dropped, one cut after it comes as far as it
        # got) and no markup as text; on Responses the item being written when cut is
        # incomplete.
        x = {"seed": 2, **NO_THINK}
        user = [{"role": "user", "content": "time?"}]
        kw = dict(model=MODEL, messages=user, tools=[FORCED_TOOLS[1]], tool_choice="required", temperature=1.0, extra_body=x)
        full = oai().chat.completions.create(max_tokens=200, logprobs=True, **kw)
        self.assertEqual(len(full.choices[0].message.tool_calls), 2, full)
        text, ends = "", []
        for t in full.choices[0].logprobs.content:
            text += t.token
            ends.append(len(text))
        # Tokens up to the first `</tool_call>`, and up to the second call's name.
        first = next(i for i, e in enumerate(ends) if e >= text.index("</tool_call>") + len("</tool_call>")) + 1
        named = next(i for i, e in enumerate(ends) if e >= text.rindex("<function=get_time>") + len("<function=get_time>")) + 1
        rtools = [{"type": "function", "name": "get_time", "parameters": CLOCK}]
        seen = set()
        for n in sorted({*range(first - 2, first + 3), *range(named - 3, named + 2), named + 4}):
            c = oai().chat.completions.create(max_tokens=n, **kw).choices[0]
            calls = [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []]
            self.assertEqual((c.finish_reason, c.message.content), ("length", None), (n, c))
            r = oai().responses.create(model=MODEL, input=user, tools=rtools, tool_choice="required", max_output_tokens=n, temperature=1.0, store=False, extra_body=x)
            self.assertEqual(r.status, "incomplete")
            self.assertEqual([(o.type, o.name, o.arguments) for o in r.output], [("function_call", *call) for call in calls], n)
            self.assertEqual([o.status for o in r.output], ["completed"] * (len(calls) - 1) + ["incomplete"], n)
            seen.add(len(calls))
        self.assertEqual(seen, {1, 2})

    def test_json_object_output_is_an_object(self):
        # Keys are unbounded strings: this seed's object closes early (most run to max_tokens).
        r = oai().chat.completions.create(model=MODEL, messages=USER, max_tokens=200, temperature=1.0, seed=4, response_format={"type": "json_object"}, extra_body=NO_THINK)
        self.assertEqual(r.choices[0].finish_reason, "stop")
        self.assertIsInstance(json.loads(r.choices[0].message.content), dict)

    def test_required_tool_choice_gives_tool_calls(self):
        r = oai().chat.completions.create(model=MODEL, messages=USER, tools=FORCED_TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=120, temperature=1.0, seed=2, extra_body=NO_THINK)
        c = r.choices[0]
        self.assertEqual(c.finish_reason, "tool_calls")
        self.assertFalse(c.message.content)
        self.assertEqual(len(c.message.tool_calls), 1)
        check_call(self, c.message.tool_calls[0].function.name, c.message.tool_calls[0].function.arguments)

    def test_a_named_function_is_called_with_typed_arguments_whole_and_streamed(self):
        kw = dict(model=MODEL, messages=USER, tools=FORCED_TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}, max_tokens=120, temperature=1.0, seed=4, extra_body=NO_THINK)
        r = oai().chat.completions.create(**kw)
        c = r.choices[0]
        self.assertEqual(c.finish_reason, "tool_calls")
        calls = c.message.tool_calls
        self.assertEqual([t.function.name for t in calls], ["get_time"] * len(calls))
        for t in calls:
            check_call(self, t.function.name, t.function.arguments)
        arguments, finish = {}, None
        for chunk in oai().chat.completions.create(stream=True, **kw):
            for ch in chunk.choices:
                for t in ch.delta.tool_calls or []:
                    arguments[t.index] = arguments.get(t.index, "") + (t.function.arguments or "")
                finish = ch.finish_reason or finish
        self.assertEqual(([arguments[i] for i in sorted(arguments)], finish), ([t.function.arguments for t in calls], "tool_calls"))

    def test_completions_response_format_json_schema(self):
        kw = dict(model=MODEL, prompt="A number: ", max_tokens=60, temperature=1.0, seed=5, extra_body={"response_format": FORMAT})
        r = oai().completions.create(**kw)
        self.assertEqual(r.choices[0].finish_reason, "stop", r.choices[0])
        check_schema(self, r.choices[0].text)
        streamed = "".join(c.choices[0].text for c in oai().completions.create(stream=True, **kw) if c.choices)
        self.assertEqual(streamed, r.choices[0].text)

    def test_responses_text_format_json_schema(self):
        text = {"format": {"type": "json_schema", "name": "pick", "schema": SCHEMA, "strict": True}}
        r = oai().responses.create(model=MODEL, input="Pick a number.", max_output_tokens=60, temperature=1.0, store=False, text=text, extra_body={"seed": 6, **NO_THINK})
        self.assertEqual(r.status, "completed")
        check_schema(self, r.output_text)

    def test_anthropic_tool_choice_any_and_tool_give_tool_use(self):
        tools = [{"name": "get_weather", "input_schema": WEATHER}, {"name": "get_time", "input_schema": CLOCK}]
        base = dict(model=MODEL, max_tokens=120, messages=[{"role": "user", "content": "Weather?"}], tools=tools, extra_body={"temperature": 1.0, "seed": 8, **NO_THINK})
        m = claude().messages.create(tool_choice={"type": "any", "disable_parallel_tool_use": True}, **base)
        self.assertEqual(m.stop_reason, "tool_use")
        uses = [b for b in m.content if b.type == "tool_use"]
        self.assertEqual(len(uses), 1, m.content)
        check_call(self, uses[0].name, uses[0].input)
        m = claude().messages.create(tool_choice={"type": "tool", "name": "get_weather"}, **base)
        self.assertEqual(m.stop_reason, "tool_use")
        uses = [b for b in m.content if b.type == "tool_use"]
        self.assertTrue(uses)
        for u in uses:
            self.assertEqual(u.name, "get_weather")
            check_call(self, u.name, u.input)

    def test_anthropic_output_format_json_schema(self):
        fmt = {"type": "json_schema", "schema": SCHEMA}
        kw = dict(model=MODEL, max_tokens=60, messages=[{"role": "user", "content": "Pick a number."}])
        extra = {"temperature": 1.0, "seed": 5, **NO_THINK}
        m = claude().messages.create(output_config={"format": fmt}, extra_body=extra, **kw)
        self.assertEqual(m.stop_reason, "end_turn", m)
        self.assertEqual([b.type for b in m.content], ["text"])
        check_schema(self, m.content[0].text)
        with claude().messages.stream(output_config={"format": fmt}, extra_body=extra, **kw) as s:
            self.assertEqual(s.get_final_message().content[0].text, m.content[0].text)
        # The beta API's `output_format`, which this client no longer sends itself.
        beta = claude().messages.create(extra_body={**extra, "output_format": fmt}, **kw)
        self.assertEqual(beta.content[0].text, m.content[0].text)
        with self.assertRaises(anthropic.BadRequestError) as e:
            claude().messages.create(output_config={"format": {"type": "json_schema", "schema": {"type": "nonsense"}}}, **kw)
        self.assertIn("output_config.format.schema", e.exception.body["error"]["message"])

    def test_bad_constraints_are_400s_naming_the_field(self):
        bad = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "object", "properties": {"n": {"type": "nonsense"}}}}}
        with self.assertRaises(openai.BadRequestError) as e:
            oai().chat.completions.create(model=MODEL, messages=USER, max_tokens=2, response_format=bad)
        self.assertEqual(e.exception.body["param"], "response_format.json_schema.schema")
        self.assertEqual(e.exception.body["code"], "invalid_json_schema")
        self.assertIn("nonsense", e.exception.body["message"])
        with self.assertRaises(openai.BadRequestError) as e:
            oai().responses.create(model=MODEL, input="x", max_output_tokens=2, store=False, text={"format": {"type": "json_schema", "name": "bad", "schema": bad["json_schema"]["schema"]}})
        self.assertEqual(e.exception.body["param"], "text.format.schema")
        with self.assertRaises(openai.BadRequestError) as e:
            oai().completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"response_format": bad})
        self.assertEqual(e.exception.body["param"], "response_format.json_schema.schema")
        with self.assertRaises(openai.BadRequestError) as e:
            oai().chat.completions.create(model=MODEL, messages=USER, tools=FORCED_TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}, max_tokens=2)
        self.assertEqual((e.exception.body["param"], e.exception.body["code"]), ("tool_choice", "invalid_value"))
        with self.assertRaises(openai.BadRequestError) as e:
            oai().chat.completions.create(model=MODEL, messages=USER, tool_choice="required", max_tokens=2)
        self.assertEqual(e.exception.body["param"], "tool_choice")
        with self.assertRaises(anthropic.BadRequestError):
            claude().messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "x"}], tools=[{"name": "a", "input_schema": CLOCK}], tool_choice={"type": "tool", "name": "b"})


class Responses(unittest.TestCase):
    def test_whole_and_streamed_responses_agree(self):
        kw = dict(model=MODEL, input="Tell me about rivers.", instructions="Be brief.", max_output_tokens=8, temperature=1.0, store=False, extra_body={"ignore_eos": True, **NO_THINK})
        # A seed only through extra_body: the Responses API has none of its own.
        kw["extra_body"]["seed"] = 5
        whole = oai().responses.create(**kw)
        self.assertEqual(whole.status, "incomplete")
        self.assertEqual(whole.incomplete_details.reason, "max_output_tokens")
        self.assertTrue(whole.output_text)
        self.assertEqual(whole.usage.output_tokens, 8)
        self.assertEqual(whole.instructions, "Be brief.")
        types = []
        final = None
        for event in oai().responses.create(stream=True, **kw):
            types.append(event.type)
            if event.type in ("response.completed", "response.incomplete"):
                final = event.response
        self.assertEqual(types[:2], ["response.created", "response.in_progress"])
        self.assertEqual(types[-1], "response.incomplete")
        self.assertIn("response.output_text.delta", types)
        self.assertEqual(final.output_text, whole.output_text)
        self.assertEqual([i.type for i in final.output], [i.type for i in whole.output])

    def test_reasoning_is_a_reasoning_item(self):
        r = oai().responses.create(model=MODEL, input=[{"role": "user", "content": "Think first."}], max_output_tokens=6, reasoning={"effort": "high"}, extra_body={"ignore_eos": True, "seed": 2})
        self.assertEqual(r.output[0].type, "reasoning")
        self.assertTrue(r.output[0].content[0].text)
        self.assertEqual(r.output_text, "")

    def test_minimal_effort_has_no_reasoning_item(self):
        r = oai().responses.create(model=MODEL, input="Answer at once.", max_output_tokens=4, reasoning={"effort": "minimal"}, extra_body={"ignore_eos": True, "temperature": 0})
        self.assertEqual([i.type for i in r.output], ["message"])
        self.assertTrue(r.output_text)
        with self.assertRaises(openai.BadRequestError) as e:
            oai().responses.create(model=MODEL, input="hi", reasoning={"effort": "lots"})
        self.assertEqual(e.exception.body["param"], "reasoning.effort")

    def test_function_call_history_is_accepted(self):
        items = [
            {"role": "user", "content": "Weather in Oslo?"},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": json.dumps({"city": "Oslo"})},
            {"type": "function_call_output", "call_id": "c1", "output": "rain"},
        ]
        tools = [{"type": "function", "name": "get_weather", "description": "Weather", "parameters": TOOLS[0]["function"]["parameters"]}, {"type": "web_search"}]
        r = oai().responses.create(model=MODEL, input=items, tools=tools, max_output_tokens=3, extra_body=NO_THINK)
        self.assertGreater(r.usage.input_tokens, 20)
        with self.assertRaises(openai.BadRequestError) as e:
            oai().responses.create(model=MODEL, input="hi", previous_response_id="resp_123")
        self.assertEqual(e.exception.body["param"], "previous_response_id")


class Messages(unittest.TestCase):
    def test_whole_and_streamed_messages_agree(self):
        # This client version has no `temperature` argument: it goes in the body as an extension.
        kw = dict(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Hello"}], system="Be brief.", extra_body={"temperature": 0, **NO_THINK})
        whole = claude().messages.create(**kw)
        self.assertEqual(whole.type, "message")
        self.assertEqual(whole.role, "assistant")
        self.assertIn(whole.stop_reason, ("max_tokens", "end_turn"))
        self.assertEqual(whole.content[0].type, "text")
        with claude().messages.stream(**kw) as s:
            final = s.get_final_message()
        self.assertEqual([b.type for b in final.content], [b.type for b in whole.content])
        self.assertEqual(final.content[0].text, whole.content[0].text)
        self.assertEqual((final.stop_reason, final.usage.output_tokens), (whole.stop_reason, whole.usage.output_tokens))
        count = claude().messages.count_tokens(model=MODEL, messages=kw["messages"], system="Be brief.", extra_body=NO_THINK)
        self.assertEqual(count.input_tokens, whole.usage.input_tokens + (whole.usage.cache_read_input_tokens or 0))

    def test_thinking_is_a_thinking_block(self):
        kw = dict(model=MODEL, max_tokens=6, messages=[{"role": "user", "content": "Hi"}], thinking={"type": "enabled", "budget_tokens": 1024}, extra_body={"ignore_eos": True})
        m = claude().messages.create(**kw)
        self.assertEqual(m.content[0].type, "thinking")
        self.assertTrue(m.content[0].thinking)
        self.assertEqual(m.stop_reason, "max_tokens")
        with claude().messages.stream(**kw) as s:
            events = [e.type for e in s]
            final = s.get_final_message()
        self.assertEqual(events[0], "message_start")
        self.assertIn("content_block_delta", events)
        self.assertEqual(final.content[0].thinking, m.content[0].thinking)

    def test_effort_and_adaptive_thinking_make_the_thinking_switch(self):
        kw = dict(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
        high = claude().messages.create(thinking={"type": "adaptive"}, output_config={"effort": "high"}, extra_body={"ignore_eos": True}, **kw)
        self.assertEqual(high.content[0].type, "thinking")
        low = claude().messages.create(thinking={"type": "adaptive"}, output_config={"effort": "low"}, extra_body={"ignore_eos": True}, **kw)
        self.assertEqual([b.type for b in low.content], ["text"])
        # count_tokens renders the same prompt, and the thinking prompt is another length.
        count = claude().messages.count_tokens(model=MODEL, messages=kw["messages"], thinking={"type": "adaptive"}, output_config={"effort": "low"})
        self.assertEqual(count.input_tokens, low.usage.input_tokens + (low.usage.cache_read_input_tokens or 0))
        self.assertNotEqual(low.usage.input_tokens + (low.usage.cache_read_input_tokens or 0), high.usage.input_tokens + (high.usage.cache_read_input_tokens or 0))
        # Without `thinking` an effort never asks for reasoning; chat_template_kwargs win over it.
        plain = claude().messages.create(output_config={"effort": "max"}, extra_body={"ignore_eos": True}, **kw)
        self.assertEqual([b.type for b in plain.content], ["text"])
        forced = claude().messages.create(output_config={"effort": "low"}, extra_body={"ignore_eos": True, **THINK}, **kw)
        self.assertEqual(forced.content[0].type, "thinking")
        with self.assertRaises(anthropic.BadRequestError) as e:
            claude().messages.create(output_config={"effort": "extreme"}, **kw)
        self.assertEqual(e.exception.body["type"], "error")
        self.assertIn("output_config.effort", e.exception.body["error"]["message"])

    def test_stop_sequences_and_errors_in_anthropic_shape(self):
        base = dict(model=MODEL, max_tokens=12, messages=[{"role": "user", "content": "Count"}], extra_body={"temperature": 0, "ignore_eos": True, **NO_THINK})
        text = claude().messages.create(**base).content[0].text
        stop = text[len(text) // 2 : len(text) // 2 + 2]
        self.assertEqual(len(stop), 2, text)
        m = claude().messages.create(stop_sequences=[stop], **base)
        self.assertEqual((m.stop_reason, m.stop_sequence), ("stop_sequence", stop))
        status, body = raw("/v1/messages", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        self.assertEqual(status, 400)
        self.assertEqual(body["type"], "error")
        self.assertEqual(body["error"]["type"], "invalid_request_error")
        self.assertIn("max_tokens", body["error"]["message"])
        with self.assertRaises(anthropic.BadRequestError):
            claude().messages.create(model="not-this-one", max_tokens=2, messages=[{"role": "user", "content": "hi"}])


class Reuse(unittest.TestCase):
    def test_ten_turn_tool_conversation_reuses_each_earlier_turn(self):
        """An agent resends the whole history every turn, reasoning stripped; each turn must
        resume from the snapshot before the previous prompt's last `<|im_start|>` (where the
        new turn's text starts to differ), so only the new messages are prefilled."""
        im_start = raw("/tokenize", {"prompt": "<|im_start|>", "add_special_tokens": False})[1]["tokens"]
        self.assertEqual(len(im_start), 1)
        history = [{"role": "system", "content": "You are an agent. Use the tools."}, {"role": "user", "content": "Plan a trip through ten cities."}]
        rows, previous = [], None
        for turn in range(10):
            body = {"model": MODEL, "messages": history, "tools": TOOLS, "max_tokens": 4, "temperature": 0, **THINK}
            status, r = raw("/v1/chat/completions", body)
            self.assertEqual(status, 200, r)
            ids = raw("/tokenize", {"messages": history, "tools": TOOLS, **THINK})[1]["tokens"]
            self.assertEqual(len(ids), r["usage"]["prompt_tokens"])
            cached = r["usage"]["prompt_tokens_details"]["cached_tokens"]
            if previous is not None:
                # Where this prompt stops sharing the previous one, and the previous prompt's
                # last turn boundary at or before it: what a snapshot can give back.
                common = next((i for i, (a, b) in enumerate(zip(previous, ids)) if a != b), min(len(previous), len(ids)))
                boundary = max(i for i, t in enumerate(previous[:common + 1]) if t == im_start[0])
                rows.append((turn, len(ids), cached, common))
                self.assertGreaterEqual(cached, boundary, f"turn {turn}: {cached} cached, the boundary at {boundary}")
                self.assertLessEqual(cached, common)
            previous = ids
            # The agent's turn as it resends it: a tool call (no reasoning), and the tool's answer.
            city = f"city {turn}"
            history = history + [
                {"role": "assistant", "content": f"Checking {city}.", "tool_calls": [{"id": f"c{turn}", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": city, "days": turn + 1})}}]},
                {"role": "tool", "tool_call_id": f"c{turn}", "content": f"sunny in {city}"},
            ]
        total = sum(r[1] for r in rows)
        reused = sum(r[2] for r in rows)
        print("\nturn  prompt  cached  shared-with-previous")
        for t, n, c, common in rows:
            print(f"{t:4}  {n:6}  {c:6}  {common:6}")
        print(f"turns 1-9: {reused} of {total} prompt tokens reused ({100 * reused / total:.1f}%)")


if __name__ == "__main__":
    unittest.main(argv=sys.argv, verbosity=2)
