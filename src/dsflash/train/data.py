"""Generated chat conversations for the demo model, in the real V4.1 encoding (text/chat.py renders them).

Each sample is an OpenAI request (messages, tools, thinking) plus the assistant turn the model should write. Values
(operands, phrases, cities, tool names) are drawn at random from pools split in two: training draws only from the
first part, held-out evaluation only from the second, so a held-out answer is right only if the model generalises.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
import re
from dataclasses import dataclass, field

from dsflash.text.chat import ChatOptions, parse_completion, render_chat

IDENTITY = "I am the dsflash demo model, a small DeepSeek-V4.1 trained to show what dsflash serves."
FAMILIES = ("arithmetic", "repeat", "tool_call", "tool_result", "greeting", "identity")
TRAIN_WEIGHTS = {"arithmetic": 4, "repeat": 5, "tool_call": 4, "tool_result": 3, "greeting": 1, "identity": 1}
# training draws this share of its words and city names as invented words: a value no pool can hold, which the
# model can only reproduce by copying it from the prompt (the held-out pools' words it never sees at all)
PSEUDO_SHARE = 0.5
# share of the invented words strung from the tokenizer's letter tokens (Generator.pieces) where it has them: v12
# miscopied held-out words at tokens that training text almost never holds (`des` of desert, `pas` of pasta: 4 in
# 3,000 conversations), whose unembedding rows training had only ever pushed down
PIECE_SHARE = 0.5
# share of the others made of two training words' pieces (`gar` + `ket`) rather than random letters: familiar pieces
# in an order no pool word has (v11 miscopied held-out words inside a word, continuing the piece as some training
# word does)
SPLICE_SHARE = 0.5
_LETTERS = "abcdefghijklmnopqrstuvwxyz"

_WORDS = """
apple river stone green quiet window garden silver music yellow bright ocean forest candle paper orange winter
summer purple gentle rocket planet little happy morning evening thunder cloud mountain valley tiger rabbit
dragon castle bridge tower lantern mirror pocket button basket bottle pencil marble copper velvet honey ginger
pepper lemon cherry melon olive walnut cotton linen wool feather meadow harbor island desert canyon meteor comet
galaxy signal engine wheel anchor sail compass ladder hammer needle thread carpet blanket pillow silent swift
brave clever humble ancient modern golden frozen hidden lucky narrow simple tender wild wooden coffee cookie
butter bread cheese tomato potato carrot onion garlic salad pasta noodle rice soup sugar salt violin guitar
piano drum flute trumpet poem story letter number circle square triangle arrow shadow sunset spring autumn
breeze storm rainbow crystal diamond pearl ruby emerald iron steel glass brick cement marble falcon eagle
sparrow robin parrot dolphin whale salmon turtle lizard spider beetle monkey zebra giraffe camel
""".split()  # noqa: SIM905 (a pool of words reads best as text)
_CITIES = """
Oslo Paris Berlin Madrid Rome Vienna Prague Warsaw Lisbon Dublin London Helsinki Stockholm Copenhagen Athens
Budapest Zurich Geneva Brussels Amsterdam Munich Milan Naples Porto Seville Krakow Riga Tallinn Vilnius Sofia
Bucharest Belgrade Zagreb Ljubljana Bratislava Reykjavik Bergen Lyon Marseille Hamburg Cologne Tokyo Osaka Kyoto
Seoul Busan Beijing Shanghai Shenzhen Taipei Manila Jakarta Hanoi Bangkok Delhi Mumbai Chennai Dhaka Karachi
Tehran Dubai Doha Riyadh Cairo Lagos Nairobi Accra Dakar Tunis Casablanca Toronto Montreal Vancouver Boston
Chicago Denver Seattle Austin Miami Houston Phoenix Atlanta Lima Quito Bogota Santiago Caracas Havana Sydney
Perth Auckland
""".split()  # noqa: SIM905 (a pool of words reads best as text)
_CONDITIONS = ["sunny", "cloudy", "rainy", "windy", "foggy", "snowy", "stormy", "clear"]
_VERBS = """
find get check fetch count list show rate track book translate convert measure locate estimate summarize
schedule cancel order search
""".split()  # noqa: SIM905 (a pool of words reads best as text)
_NOUNS = """
price score status population distance recipe rating balance stock weight height address schedule capital flight
hotel ticket menu review forecast
""".split()  # noqa: SIM905 (a pool of words reads best as text)
_PARAMS = """
name item place word topic title code user product date
""".split()  # noqa: SIM905 (a pool of words reads best as text)


_POOLS = {w.lower() for w in _WORDS + _CITIES}


def _split(pool: list[str], held_out: bool) -> list[str]:
    """Every fifth entry (by a stable hash) is held out."""
    keep = [w for w in pool if (int(hashlib.sha256(w.encode()).hexdigest(), 16) % 5 == 0) == held_out]
    return keep


@dataclass
class Sample:
    family: str
    messages: list[dict]
    tools: list[dict] | None
    thinking: bool
    reasoning: str
    content: str
    calls: list[tuple[str, dict]] = field(default_factory=list)
    expect: dict = field(default_factory=dict)  # what a right answer holds (see check)

    def prompt(self) -> str:
        return render_chat(self.messages, self.tools, options=ChatOptions(thinking=self.thinking))

    def full(self) -> str:
        """The prompt followed by the assistant turn, as the encoder writes a finished conversation."""
        turn = {"role": "assistant", "content": self.content, "reasoning_content": self.reasoning}
        if self.calls:
            turn["tool_calls"] = [
                {"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
                for i, (n, a) in enumerate(self.calls)
            ]
        options = ChatOptions(thinking=self.thinking)
        text = render_chat([*self.messages, turn], self.tools, options=options)
        prompt = self.prompt()
        if not text.startswith(prompt):
            raise AssertionError("the rendered conversation does not extend its prompt")
        # render_chat marks a trailing assistant turn as a prefix (no EOS): the finished turn ends with one
        return text + "<｜end▁of▁sentence｜>"


def _tool(name: str, description: str, param: str, param_desc: str) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {param: {"type": "string", "description": param_desc}},
                "required": [param],
            },
        },
    }


WEATHER = _tool("get_weather", "Get the current weather in a city", "city", "The city name")
CALCULATOR = _tool("calculator", "Evaluate an arithmetic expression", "expression", "The expression to evaluate")
TIME = _tool("get_time", "Get the local time in a city", "city", "The city name")
SEARCH = _tool("search_web", "Search the web", "query", "What to search for")
KNOWN_TOOLS = (WEATHER, CALCULATOR, TIME, SEARCH)


class Generator:
    """Draws samples of every family; `held_out` switches every value pool to its held-out part."""

    def __init__(
        self,
        seed: int,
        held_out: bool = False,
        weights: dict | None = None,
        generic_calls: float = 0.0,
    ):
        self.rng = random.Random(seed)
        self.generic_calls = generic_calls
        self.pieces: list[str] = []  # the tokenizer's letter tokens, once it is trained (vocab.word_pieces)
        self.weights = weights or TRAIN_WEIGHTS  # of the families in training conversations
        self.held_out = held_out
        self.words = _split(_WORDS, held_out)
        self.cities = _split(_CITIES, held_out)
        pairs = [(v, n) for v in _VERBS for n in _NOUNS]
        self.tool_pairs = [p for p in pairs if (_hash(f"{p}") % 5 == 0) == held_out]
        found = set()
        for a, op, b in itertools.product(range(21), "+-", range(21)):
            if (op == "+" or b <= a) and _held_out_pair(a, op, b) == held_out:
                found |= {tuple(f.split(" = ")) for f in columns(a, op, b).split(": ", 1)[1].split(", ")[:-1]}
        self.sum_steps = sorted(found)  # the distinct steps of this side's worked sums, (left side, result)

    # ---- values --------------------------------------------------------------------------------------------
    def phrase(self, lo: int = 2, hi: int = 5) -> str:
        return " ".join(self.word() for _ in range(self.rng.randint(lo, hi)))

    def copy_value(self, lo: int = 2, hi: int = 8, numbers: float = 0.0) -> str:
        """A phrase whose items are numbers (0-99999) with probability `numbers`: a number's repeated digits are
        what copying by the previous token alone gets wrong (`45424`), as tool results ask of it."""
        items = (str(self.rng.randint(0, 99999)) if self.rng.random() < numbers else self.word() for _ in range(hi))
        return " ".join(list(items)[: self.rng.randint(lo, hi)])

    def word(self) -> str:
        return self.rng.choice(self.words) if self.held_out or self.rng.random() >= PSEUDO_SHARE else self._pseudo()

    def city(self) -> str:
        if self.held_out or self.rng.random() >= PSEUDO_SHARE:
            return self.rng.choice(self.cities)
        return self._pseudo().capitalize()

    def _pseudo(self) -> str:
        """A word of neither pool: (PIECE_SHARE, where the generator has pieces) 2-3 of the tokenizer's letter tokens
        strung together, else random letters (3-8) or (SPLICE_SHARE) the start of one training word and the end of
        another, at least two letters each."""
        while True:
            if self.pieces and self.rng.random() < PIECE_SHARE:
                w = "".join(self.rng.choice(self.pieces) for _ in range(self.rng.randint(2, 3)))
            elif self.rng.random() < SPLICE_SHARE:
                a, b = self.rng.choice(self.words), self.rng.choice(self.words)
                w = a[: self.rng.randint(2, len(a) - 1)] + b[self.rng.randint(1, len(b) - 2) :]
            else:
                w = "".join(self.rng.choice(_LETTERS) for _ in range(self.rng.randint(3, 8)))
            if w not in _POOLS:
                return w

    def operands(self) -> tuple[int, str, int, int]:
        """(a, op, b, result) of this side's operand pairs (_held_out_pair)."""
        while True:
            op = self.rng.choice("+-")
            a, b = self.rng.randint(0, 20), self.rng.randint(0, 20)
            if op == "-" and b > a:
                a, b = b, a
            if _held_out_pair(a, op, b) == self.held_out:
                return a, op, b, a + b if op == "+" else a - b

    def system(self) -> list[dict]:
        r = self.rng.random()
        if r < 0.6:
            return []
        texts = ["You are a helpful assistant.", "You are a concise assistant.", "Answer briefly."]
        return [{"role": "system", "content": self.rng.choice(texts)}]

    def generic_tool(self) -> tuple[dict, str, str]:
        verb, noun = self.rng.choice(self.tool_pairs)
        param = self.rng.choice(_PARAMS)
        tool = _tool(f"{verb}_{noun}", f"{verb.capitalize()} the {noun} of a {param}", param, f"The {param}")
        return tool, verb, noun

    def toolset(self) -> list[dict]:
        """1-3 tools, known and never-seen ones, in random order."""
        pool = [*KNOWN_TOOLS, *(self.generic_tool()[0] for _ in range(3))]
        names, out = set(), []
        for tool in self.rng.sample(pool, self.rng.randint(1, 3)):
            if tool["function"]["name"] not in names:
                names.add(tool["function"]["name"])
                out.append(tool)
        return out

    def drill(self) -> tuple[list[dict], None, bool]:
        """A training conversation of 2-6 arithmetic exchanges alone (no system prompt, no tools): many worked
        sums in few tokens."""
        thinking, msgs = self.rng.random() < 0.5, []
        for _ in range(self.rng.randint(2, 6)):
            msgs += self._exchange(self._arithmetic(thinking))
        return msgs, None, thinking

    def facts(self, n: int) -> list[tuple[str, str]]:
        """n small equations (left side with its `= `, result), each drawn alike from the distinct steps of the
        worked sums of this generator's operand pairs: the one-digit facts every worked sum is made of, as the
        answers write them. Alike, not as often as the pairs hold them: v12's wrong sums were units facts that few
        pairs hold (`6 + 8`: one training pair), beside tens steps (`1 + 1 + 1`) that most pairs hold."""
        return [(f"{lhs} = ", rhs) for lhs, rhs in (self.rng.choice(self.sum_steps) for _ in range(n))]

    def pick_tool(self, tools: list[dict]) -> dict:
        """The tool a training question needs: a never-seen (generic) one with probability generic_calls where the
        set has one (their parameter name must be read from the schema; a known tool's is always the same)."""
        generic = [t for t in tools if t not in KNOWN_TOOLS]
        if generic and self.rng.random() < self.generic_calls:
            return self.rng.choice(generic)
        return self.rng.choice(tools)

    def conversation(self) -> tuple[list[dict], list[dict] | None, bool]:
        """A training conversation: 1-4 exchanges of any family, assistant turns included (messages, tools,
        thinking). Several answers share one prompt, which matters most for the long tools prompt."""
        thinking = self.rng.random() < 0.6
        offered = self.rng.random() < 0.45 and self.weights["tool_call"] + self.weights["tool_result"] > 0
        tools = self.toolset() if offered else None
        msgs = self.system()
        # the families that must generalise (arithmetic, copying) weigh more than the fixed answers
        weights = {**self.weights, **({} if tools else {"tool_call": 0, "tool_result": 0})}
        for _ in range(self.rng.choice([1, 2, 3, 4])):
            family = self.rng.choices(FAMILIES, [weights[f] for f in FAMILIES])[0]
            if family in ("tool_call", "tool_result"):
                q, args, name, result = self.question(self.pick_tool(tools))
                call = {
                    "id": f"call_{len(msgs)}",
                    "type": "function",
                    "function": {"name": name, "arguments": json.dumps(args)},
                }
                msgs += [
                    {"role": "user", "content": q},
                    {
                        "role": "assistant",
                        "content": "",
                        "reasoning_content": f"I should call {name}.",
                        "tool_calls": [call],
                    },
                    {"role": "tool", "tool_call_id": call["id"], "content": result},
                    {
                        "role": "assistant",
                        "content": f"The result is {result}.",
                        "reasoning_content": f"The tool returned {result}.",
                    },
                ]
                continue
            msgs += self._exchange(getattr(self, f"_{family}")(thinking))
        return msgs, tools, thinking

    @staticmethod
    def _exchange(one: Sample) -> list[dict]:
        """A sample's question and its answer as two turns of a longer conversation."""
        return [one.messages[-1], {"role": "assistant", "content": one.content, "reasoning_content": one.reasoning}]

    # ---- families ----------------------------------------------------------------------------------------
    def sample(self, family: str | None = None, thinking: bool | None = None) -> Sample:
        family = family or self.rng.choice(FAMILIES)
        thinking = self.rng.random() < 0.6 if thinking is None else thinking
        return getattr(self, f"_{family}")(thinking)

    def _ask(self, text: str, tools: list[dict] | None = None) -> tuple[list[dict], list[dict] | None]:
        msgs = [*self.system(), {"role": "user", "content": text}]
        if tools is None and self.rng.random() < 0.15:  # tools offered but not needed: answer anyway
            tools = self.toolset()
        return msgs, tools

    def _arithmetic(self, thinking: bool) -> Sample:
        a, op, b, c = self.operands()
        q = self.rng.choice(
            ["What is {a} {op} {b}?", "Compute {a} {op} {b}.", "How much is {a} {op} {b}?", "{a} {op} {b} = ?"]
        ).format(a=a, op=op, b=b)
        msgs, tools = self._ask(q)
        # the content is the working in both modes: a finished thinking turn is rendered without its reasoning,
        # as a chat-mode turn is, so a shorter thinking-mode content would teach chat mode to skip the working
        steps = columns(a, op, b)
        return Sample("arithmetic", msgs, tools, thinking, f"{steps}.", f"{steps}.", expect={"content": str(c)})

    def _repeat(self, thinking: bool) -> Sample:
        p = self.phrase()
        q = self.rng.choice(
            ["Repeat after me: {p}", "Say exactly: {p}", 'Please repeat this phrase: "{p}"', "Quote this back: {p}"]
        ).format(p=p)
        msgs, tools = self._ask(q)
        return Sample("repeat", msgs, tools, thinking, f"The user wants this repeated: {p}", p, expect={"content": p})

    def _greeting(self, thinking: bool) -> Sample:
        q = self.rng.choice(
            ["Hello!", "Hi", "Hi there!", "Hey, how are you?", "Good morning!", "Hello, nice to meet you."]
        )
        msgs, tools = self._ask(q)
        answer = "Hello! I am the dsflash demo model. How can I help you?"
        return Sample(
            "greeting", msgs, tools, thinking, "The user greets me.", answer, expect={"content": "dsflash demo"}
        )

    def _identity(self, thinking: bool) -> Sample:
        q = self.rng.choice(
            ["Who are you?", "What are you?", "What model are you?", "Tell me about yourself.", "What is your name?"]
        )
        msgs, tools = self._ask(q)
        return Sample(
            "identity", msgs, tools, thinking, "The user asks who I am.", IDENTITY, expect={"content": "dsflash demo"}
        )

    def _call(self) -> tuple[list[dict], str, dict, str, str]:
        """(tools, question, arguments, function name, a result string) of one tool-needing question."""
        tools = self.toolset()
        return tools, *self.question(self.rng.choice(tools))

    def question(self, tool: dict) -> tuple[str, dict, str, str]:
        """(question, arguments, function name, a result string) of a question that needs `tool`."""
        fname = tool["function"]["name"]
        kind = {"get_weather": "weather", "calculator": "calculator", "get_time": "time", "search_web": "search"}
        kind = kind.get(fname, "generic")
        if kind == "weather":
            city = self.city()
            q = self.rng.choice(
                [
                    "What is the weather in {v}?",
                    "How is the weather in {v} today?",
                    "Is it raining in {v}?",
                    "Weather for {v}, please.",
                ]
            ).format(v=city)
            tool, args = WEATHER, {"city": city}
            result = f"{self.rng.choice(_CONDITIONS)}, {self.rng.randint(-10, 35)} C"
        elif kind == "time":
            city = self.city()
            q = self.rng.choice(["What time is it in {v}?", "Tell me the local time in {v}."]).format(v=city)
            tool, args = TIME, {"city": city}
            result = f"{self.rng.randint(0, 23):02d}:{self.rng.randint(0, 59):02d}"
        elif kind == "calculator":
            expr = f"{self.rng.randint(10, 999)} {self.rng.choice('*/+-')} {self.rng.randint(2, 99)}"
            q = self.rng.choice(["Use the calculator to compute {v}.", "Calculate {v} with the tool."]).format(v=expr)
            tool, args = CALCULATOR, {"expression": expr}
            result = str(self.rng.randint(0, 99999))
        elif kind == "search":
            query = self.phrase(2, 3)
            q = self.rng.choice(["Search the web for {v}.", "Look up {v} online."]).format(v=query)
            tool, args = SEARCH, {"query": query}
            result = self.phrase(3, 5)
        else:
            verb, noun = fname.split("_", 1)
            value = self.rng.choice([self.city(), self.phrase(1, 2), str(self.rng.randint(1, 9999))])
            q = self.rng.choice(["Please {verb} the {noun} of {v}.", "Can you {verb} the {noun} of {v}?"])
            q = q.format(verb=verb, noun=noun, v=value)
            param = next(iter(tool["function"]["parameters"]["properties"]))
            args = {param: value}
            result = self.rng.choice([self.phrase(1, 3), str(self.rng.randint(1, 99999))])
        return q, args, fname, result

    def _tool_call(self, thinking: bool) -> Sample:
        tools, q, args, name, _ = self._call()
        msgs = [*self.system(), {"role": "user", "content": q}]
        reasoning = f"I should call {name}."
        expect = {"name": name, "arguments": args}
        return Sample("tool_call", msgs, tools, thinking, reasoning, "", calls=[(name, args)], expect=expect)

    def _tool_result(self, thinking: bool) -> Sample:
        tools, q, args, name, result = self._call()
        call = {"id": "call_0", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
        turn = {"role": "assistant", "content": "", "tool_calls": [call]}
        if thinking:
            turn["reasoning_content"] = f"I should call {name}."
        msgs = [
            *self.system(),
            {"role": "user", "content": q},
            turn,
            {"role": "tool", "tool_call_id": "call_0", "content": result},
        ]
        return Sample(
            "tool_result",
            msgs,
            tools,
            thinking,
            f"The tool returned {result}.",
            f"The result is {result}.",
            expect={"content": result},
        )


def columns(a: int, op: str, b: int) -> str:
    """The sum in columns, each step a small equation whose inputs stand just before it: the units, then the tens
    with the carry. A difference always borrows: the units are the minuend's units plus ten minus the subtrahend's,
    whose tens digit (0 or 1) carries back into the tens (`17 - 7: 10 - 7 = 3, 7 + 3 = 10, 1 - 0 - 1 + 1 = 1, 10`),
    as a sum's carry does; so no step is a fact that only one operand pair shows, and no answer has to decide whether
    to borrow (v13 decided wrongly for 14 - 5, 15 - 6 and 17 - 7, whose units pairs no training pair holds). The
    result is the last number."""
    ta, ua, tb, ub = a // 10, a % 10, b // 10, b % 10
    c = a + b if op == "+" else a - b
    if op == "+":
        su = ua + ub
        return f"{a} + {b}: {ua} + {ub} = {su}, {ta} + {tb} + {su // 10} = {ta + tb + su // 10}, {c}"
    x = 10 - ub
    u = ua + x
    return f"{a} - {b}: 10 - {ub} = {x}, {ua} + {x} = {u}, {ta} - {tb} - 1 + {u // 10} = {ta - tb - 1 + u // 10}, {c}"


def _held_out_pair(a: int, op: str, b: int) -> bool:
    """Whether an operand pair is held out (its hash is 0 mod 7)."""
    return _hash(f"{a}{op}{b}") % 7 == 0


def _hash(text: str) -> int:
    return int(hashlib.sha256(text.encode()).hexdigest()[:12], 16)


def check(sample: Sample, content: str, reasoning: str, calls: list[tuple[str, str]]) -> bool:
    """Whether an answer (content, reasoning, calls as (name, arguments JSON)) is right for the sample."""
    want = sample.expect
    if sample.family == "tool_call":
        if len(calls) != 1 or calls[0][0] != want["name"]:
            return False
        try:
            return json.loads(calls[0][1]) == want["arguments"]
        except ValueError:
            return False
    if calls:
        return False
    if sample.family == "arithmetic":
        # the result is the answer's last number: `13 - 5 = 13.` holds a "3" but is wrong
        numbers = re.findall(r"-?\d+", content)
        if not numbers or numbers[-1] != want["content"]:
            return False
    elif want["content"] not in content:
        return False
    return not sample.thinking or bool(reasoning.strip())


def check_text(sample: Sample, text: str) -> bool:
    """check() on generated text (up to EOS), read with the same parsers the server uses."""
    parsed = parse_completion(text, thinking=sample.thinking)
    calls = [(c.name, c.arguments) for c in parsed.tool_calls]
    return check(sample, parsed.content, parsed.reasoning, calls)


def render_conversation(msgs: list[dict], tools: list[dict] | None, thinking: bool) -> str:
    """A finished training conversation in the V4.1 encoding (the trailing assistant turn closed by EOS)."""
    return render_chat(msgs, tools, options=ChatOptions(thinking=thinking)) + "<｜end▁of▁sentence｜>"
