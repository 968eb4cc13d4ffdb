"""Offline prompts for distillation, in the domains users prompt (the Spec-Bench categories), never its prompts.

Three kinds of material, all built on this machine:
- templates x topics written for verispec (`topics.py`): questions, word problems, coding and writing tasks,
  composed German/French/Spanish sentences to translate;
- prose from the local Python install (`pydoc_data.topics` and stdlib docstrings, read without importing), and
  stdlib function sources to explain;
- articles and encyclopedia passages the target itself writes (`material_requests`), used as documents to
  summarise and as retrieval passages to answer from.

Every builder takes a seeded `random.Random`, so the prompt list is a pure function of the seed.
"""

from __future__ import annotations

import ast
import random
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from verispec.distill import topics as T

# Share of each category in the built-in prompt mix: the five Spec-Bench categories evenly, the MT-bench ones less.
CATEGORY_WEIGHTS = {
    "translation": 0.14, "summarization": 0.14, "qa": 0.14, "math_reasoning": 0.14, "rag": 0.14,
    "writing": 0.04, "roleplay": 0.03, "reasoning": 0.03, "math": 0.03, "coding": 0.06, "extraction": 0.03,
    "stem": 0.04, "humanities": 0.04,
}


@dataclass(frozen=True)
class Prompt:
    """One user message to send to the target through its chat template."""

    category: str
    text: str


def material_requests(n: int, seed: int) -> list[str]:
    """User messages asking the target for news articles and encyclopedia passages (documents for later prompts)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 2 == 0:
            out.append(rng.choice([
                "Write a news article about {event} in {city}.",
                "Write a detailed newspaper report about {event} in {city}. Include quotes from people involved.",
                "Write a news story for a local paper about {event} in {city}.",
            ]).format(event=rng.choice(T.EVENTS), city=rng.choice(T.CITIES)))
        else:
            out.append(rng.choice([
                "Write an encyclopedia article about {topic}.",
                "Write a detailed, factual article about {topic} with its history and key facts.",
                "Write a Wikipedia-style article about {topic}.",
            ]).format(topic=rng.choice(T.TOPICS + T.SCIENCE_CONCEPTS)))
    return out


def build_prompts(n: int, seed: int, documents: list[str]) -> list[Prompt]:
    """`n` prompts in the proportions of `CATEGORY_WEIGHTS`, shuffled; `documents` are texts to summarise/retrieve."""
    rng = random.Random(seed)
    docs = [d for d in documents if len(d) > 200] + stdlib_prose(seed)
    functions = stdlib_functions(seed)
    seen: set[str] = set()
    out: list[Prompt] = []
    attempts = 0
    while len(out) < n and attempts < 20 * n + 100:
        attempts += 1
        prompt = domain_prompt(rng, docs, functions)
        if prompt.text not in seen:
            seen.add(prompt.text)
            out.append(prompt)
    return out


def domain_prompt(rng: random.Random, docs: list[str], functions: list[str]) -> Prompt:
    """One prompt of a category drawn by `CATEGORY_WEIGHTS`, all of its randomness from `rng`; `docs`: texts to
    summarise/retrieve/extract from, `functions`: sources to explain."""
    builders = {
        "translation": lambda: _translation(rng),
        "summarization": lambda: _summarization(rng, docs),
        "qa": lambda: _qa(rng),
        "math_reasoning": lambda: _math_reasoning(rng),
        "rag": lambda: _rag(rng, docs),
        "writing": lambda: _writing(rng),
        "roleplay": lambda: _roleplay(rng),
        "reasoning": lambda: _reasoning(rng),
        "math": lambda: _math(rng),
        "coding": lambda: _coding(rng, functions),
        "extraction": lambda: _extraction(rng, docs),
        "stem": lambda: _stem(rng),
        "humanities": lambda: _humanities(rng),
    }
    category = rng.choices(list(CATEGORY_WEIGHTS), list(CATEGORY_WEIGHTS.values()))[0]
    return Prompt(category, builders[category]())


# --- material from the local Python install --------------------------------------------------------------------

def stdlib_prose(seed: int, limit: int = 400) -> list[str]:
    """Paragraph-rich prose from the Python reference (`pydoc_data/topics.py`) and stdlib module docstrings."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    topics_file = stdlib / "pydoc_data" / "topics.py"
    if topics_file.is_file():
        try:
            tree = ast.parse(topics_file.read_text(encoding="utf-8"))
            for node in ast.walk(tree):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and len(node.value) > 600:
                    texts.append(_clean_prose(node.value)[:3000])
        except (SyntaxError, UnicodeDecodeError):
            pass
    for path in sorted(stdlib.glob("*.py")):
        for doc in _docstrings(path):
            if len(doc) > 400:
                texts.append(_clean_prose(doc)[:3000])
    rng = random.Random(seed)
    rng.shuffle(texts)
    return texts[:limit]


def stdlib_functions(seed: int, limit: int = 300) -> list[str]:
    """Sources of short, documented stdlib functions (5-30 lines), for "explain this code" prompts."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out: list[str] = []
    for path in sorted(stdlib.glob("*.py")):
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        lines = source.split("\n") if "\r" not in source else None
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and 5 <= node.end_lineno - node.lineno <= 30:
                segment = _segment(lines, node) if lines is not None else ast.get_source_segment(source, node)
                if segment and not node.name.startswith("_"):
                    out.append(segment)
    rng = random.Random(seed)
    rng.shuffle(out)
    return out[:limit]


def _segment(lines: list[str], node: ast.AST) -> str:
    """`ast.get_source_segment` for a source of "\\n" lines, split once (that function splits the whole source
    on every call: 6 s for the stdlib's functions); column offsets are UTF-8 byte offsets, as there."""
    first, last = node.lineno - 1, node.end_lineno - 1
    if first == last:
        return lines[first].encode()[node.col_offset:node.end_col_offset].decode()
    head = lines[first].encode()[node.col_offset:].decode()
    tail = lines[last].encode()[:node.end_col_offset].decode()
    return "\n".join([head, *lines[first + 1:last], tail])


def _docstrings(path: Path) -> list[str]:
    """Docstrings of a module and its top-level classes and functions, read without importing it."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
        return []
    nodes = [tree] + [n for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))]
    return [doc for doc in (ast.get_docstring(n) for n in nodes) if doc]


def _clean_prose(text: str) -> str:
    """Join wrapped lines into paragraphs and drop reST markup, keeping sentence text."""
    text = re.sub(r"\*\*\*+|\=\=\=+|\-\-\-+|\*\*|``", "", text)
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text)]
    return "\n\n".join(p for p in paragraphs if p)


# --- builders, one per category ---------------------------------------------------------------------------------

def _translation(rng: random.Random) -> str:
    roll = rng.random()
    if roll < 0.8:
        if rng.random() < 0.55:
            sentence = f"{rng.choice(T.DE_SUBJECTS)} {rng.choice(T.DE_VERBS)} {rng.choice(T.DE_CLAUSES)} ."
            if "Bürgermeister" in sentence or "Stadtverwaltung" in sentence:
                sentence = sentence.replace("Der Bürgermeister", f"Der Bürgermeister von {rng.choice(T.DE_CITIES)}")
        else:
            sentence = rng.choice(T.DE_STANDALONE).format(
                city=rng.choice(T.DE_CITIES), country=rng.choice(T.DE_COUNTRIES),
                n=rng.choice([200, 500, 1000, 3000, 10000]), k=rng.randint(2, 5))
        return f"Translate German to English: {sentence}"
    if roll < 0.9:
        return f"Translate French to English: {rng.choice(T.FR_SENTENCES).format(city=rng.choice(T.CITIES))}"
    return f"Translate Spanish to English: {rng.choice(T.ES_SENTENCES).format(city=rng.choice(T.CITIES))}"


def _summarization(rng: random.Random, docs: list[str]) -> str:
    doc = rng.choice(docs)
    if rng.random() < 0.3:
        doc = doc + " " + rng.choice(docs)
    doc = _cut(doc, rng.randint(900, 4500)).replace("\n\n", " ")
    prefix = rng.choice(["Summarize: "] * 6 + ["Summarize the following text: ", "Write a short summary of this: "])
    return prefix + doc


def _rag(rng: random.Random, docs: list[str]) -> str:
    passages = [rng.choice(docs) for _ in range(rng.randint(2, 4))]
    context = _cut(" ".join(p.replace("\n\n", " ") for p in passages), rng.randint(2500, 4000))
    question = _question_about(rng, passages[0])
    return f"{context}\n{question}"


def _question_about(rng: random.Random, passage: str) -> str:
    """A natural question on the passage's subject: its first noun phrase, or a generic one."""
    words = re.findall(r"[A-Z][a-z]+(?: [A-Z][a-z]+)*", passage[:400])
    subject = rng.choice(words) if words else "this"
    return rng.choice([
        f"What is {subject}?", f"What does the text say about {subject}?", f"Why is {subject} important?",
        f"How does {subject} work?", f"What happened to {subject}?", f"Who is involved with {subject}?",
        "What is the main point of the passage?", f"When did {subject} start?", f"Describe {subject} in detail.",
    ])


def _qa(rng: random.Random) -> str:
    if rng.random() < 0.75:
        template = rng.choice(list(T.QA_FACTS))
        question = template.format(rng.choice(T.QA_FACTS[template]))
    else:
        question = rng.choice([
            "What is {t}?", "How does {t} work?", "Who discovered {t}?", "When did {t} begin?",
            "Why is {t} important?", "Where can you find {t}?", "what is the meaning of {t}?",
        ]).format(t=rng.choice(T.TOPICS + T.SCIENCE_CONCEPTS))
    if rng.random() < 0.5:  # search-engine style, as in Natural Questions
        question = question[0] + question[1:].lower()
    return question


def _math_reasoning(rng: random.Random) -> str:
    name, other = rng.sample(T.NAMES, 2)
    item, items, price = rng.choice(T.ITEMS)
    a, b, c = rng.randint(2, 12), rng.randint(2, 9), rng.randint(10, 90)
    price = round(price * rng.choice([1, 2, 3, 5]), 2)
    return rng.choice([
        f"{name} buys {a} {items} for ${price} each and pays with a ${c + int(a * price)} bill. How much change "
        f"does {name} get?",
        f"{name} has {c} {items}. {name} gives {a} to {other} and then buys {b} more. How many {items} does {name} "
        "have now?",
        f"A store sells {items} at ${price} each. On Monday it sold {c} {items} and on Tuesday it sold {a} times as "
        "many. How much money did the store make in total?",
        f"{name} reads {a} pages every weekday and {b * 3} pages each day on the weekend. How many pages does "
        f"{name} read in {b} weeks?",
        f"There are {c} students in a class. {a * 5}% of them walk to school and the rest take the bus. How many "
        "students take the bus?",
        f"{name} is {a + 10} years old. {other} is {b} years older than twice {name}'s age. How old will {other} be "
        f"in {a} years?",
        f"A train travels at {c} miles per hour for {a} hours and then at {c - 5} miles per hour for {b} hours. How "
        "far does it travel in total?",
        f"{name} saves ${c} each month. After {a} months, {name} spends ${a * 7} on a {item}. How much money is left?",
        f"A recipe needs {b} cups of flour for {a} {items}. How many cups of flour are needed for {a * c} {items}?",
        f"{name} needs {c * 10} kilos of sand for a garden. Sand comes in sacks of {a * 5} kg at ${b + 10} a "
        "sack. What will the sand cost?",
        f"{name} runs {a} miles on Monday, twice as far on Tuesday, and {b} miles less than Tuesday on Wednesday. "
        f"How many miles does {name} run in total?",
        f"A farmer has {c} chickens and {a} cows. How many legs do the animals have altogether?",
        f"{name} works {a} hours a day, {b % 5 + 3} days a week, and earns ${c / 5:.2f} per hour. How much does "
        f"{name} earn in {b} weeks?",
        f"The price of a {item} went up by {a * 5}% from ${c}. What is the new price?",
        f"{name} and {other} share {c * 2} {items} in the ratio {a}:{b}. How many {items} does {other} get?",
    ])


def _writing(rng: random.Random) -> str:
    return rng.choice([
        "Compose a blog post about a trip to {place}, highlighting the food and must-see sights.",
        "Write a persuasive essay arguing that every city should invest in {topic}.",
        "Write a short story about a child who discovers {topic}.",
        "Write a poem about {topic}.",
        "Draft a professional email to your manager asking for feedback on a report about {topic}.",
        "Write a product description for a new {product}.",
        "Write a catchy headline and a short introduction for an article about {topic}.",
        "Describe a vivid and unique character who lives in {place}.",
        "Write a letter to a friend describing your first week living in {place}.",
        "Create an outline for a blog post comparing two {product} models.",
        "Write a speech for a school graduation about the importance of {topic}.",
    ]).format(place=rng.choice(T.CITIES + T.COUNTRIES), topic=rng.choice(T.TOPICS), product=rng.choice(T.PRODUCTS))


def _roleplay(rng: random.Random) -> str:
    return rng.choice([
        "Pretend you are {p}. Explain {topic} to a group of visitors.",
        "Imagine you are {p}. Describe a typical day at work.",
        "Act as {p}. What advice would you give to someone who wants to learn about {topic}?",
        "You are {p}. Introduce yourself and tell me about your favourite memory.",
        "Role-play as {p} and convince me to visit {place}.",
    ]).format(p=rng.choice(T.PERSONAS), topic=rng.choice(T.TOPICS), place=rng.choice(T.CITIES))


def _reasoning(rng: random.Random) -> str:
    a, b = rng.sample(T.NAMES, 2)
    n = rng.randint(3, 9)
    return rng.choice([
        f"{a} is taller than {b}, and {b} is taller than Sam. Who is the shortest? Explain your reasoning.",
        f"If you overtake the person in position {n} in a race, what position are you in now?",
        "A bat and a ball cost $1.10 in total. The bat costs $1.00 more than the ball. How much does the ball cost?",
        f"{a} has {n} sisters and each sister has one brother. How many brothers does {a} have?",
        "Which word does not belong with the others: apple, banana, carrot, grape? Explain why.",
        f"If all {rng.choice(['bloops', 'zips', 'glorks'])} are razzies and some razzies are lazzies, are all "
        "bloops lazzies? Explain.",
        f"{a} leaves home at 8 am and walks {n} km per hour. {b} leaves one hour later and cycles {n * 3} km per "
        f"hour. When does {b} catch up?",
        "Why might someone who is very healthy still need to visit a hospital every day? Give possible reasons.",
    ])


def _math(rng: random.Random) -> str:
    x, y, z = rng.randint(1, 9), rng.randint(2, 12), rng.randint(2, 20)
    return rng.choice([
        f"Solve for x: {x}x + {y} = {z + y * 2}.",
        f"What is the area of a triangle with vertices at (0, 0), ({x}, 0), and (0, {y})?",
        f"Find the derivative of f(x) = {x}x^3 + {y}x^2 - {z}x + 1.",
        f"A fair die is rolled twice. What is the probability that the sum is {y % 11 + 2}?",
        f"What is the sum of all integers from 1 to {z * 10}?",
        f"If f(x) = {x}x^2 - {y}x + {z}, what is f({x})?",
        f"How many ways can you arrange the letters of a word with {x + 3} distinct letters?",
        f"What is the remainder when {z * 37 + x} is divided by {y}?",
        f"Find the circumference of a circle with radius {z} cm.",
    ])


def _coding(rng: random.Random, functions: list[str]) -> str:
    task, language = rng.choice(T.CODING_TASKS), rng.choice(T.LANGUAGES)
    if rng.random() < 0.2 and functions:
        return "Explain what the following Python function does:\n```python\n" + rng.choice(functions) + "\n```"
    return rng.choice([
        "Write a {lang} function that {task}.",
        "Develop a {lang} program that {task}.",
        "Implement a function in {lang} that {task}. Explain how it works.",
        "Write a {lang} function that {task}, with a docstring and an example.",
        "How do I write code in {lang} that {task}?",
    ]).format(lang=language, task=task)


def _extraction(rng: random.Random, docs: list[str]) -> str:
    doc = _cut(rng.choice(docs), rng.randint(500, 1500)).replace("\n\n", " ")
    return rng.choice([
        "Extract all names of people, places and organisations mentioned in the following text:\n" + doc,
        "Identify the main topic and three key facts in this text. Answer in JSON.\n" + doc,
        "Read the text below and list every number it mentions with what it refers to.\n" + doc,
        "Evaluate the following review on a scale of 1 to 5: " + _review(rng),
    ])


def _review(rng: random.Random) -> str:
    thing = rng.choice(T.PRODUCTS + ["movie", "restaurant", "hotel", "book"])
    return rng.choice([
        f"This {thing} was phenomenal. Everything about it was top-notch and I would buy it again.",
        f"I was so disappointed with this {thing}. It broke after two days and support never answered.",
        f"The {thing} was okay. Some parts were good, others were boring, and the price was fair.",
    ])


def _stem(rng: random.Random) -> str:
    return rng.choice([
        "In simple terms, what is {c} and why does it matter?",
        "Explain {c} to a high school student, with an example.",
        "How is {c} connected to {c2}? Explain both.",
        "Describe the main ideas behind {c}.",
        "What are the practical applications of {c}?",
    ]).format(c=rng.choice(T.SCIENCE_CONCEPTS), c2=rng.choice(T.SCIENCE_CONCEPTS))


def _humanities(rng: random.Random) -> str:
    return rng.choice([
        "Discuss the impact of {t} on society.",
        "What were the main causes and consequences of {t}?",
        "Compare the cultural importance of {t} in {c} and {c2}.",
        "How has {t} changed over the last hundred years?",
        "Explain the economic effects of {t}.",
        "What lessons can we learn from the history of {t}?",
    ]).format(t=rng.choice(T.TOPICS), c=rng.choice(T.COUNTRIES), c2=rng.choice(T.COUNTRIES))


def _cut(text: str, max_chars: int) -> str:
    """Truncate to at most `max_chars`, possibly mid-sentence (as retrieval chunks are), on a word boundary."""
    if len(text) <= max_chars:
        return text
    return text[:max_chars].rsplit(" ", 1)[0]
