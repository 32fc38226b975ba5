"""The templates of the generated repository tasks (:mod:`.generate`): a correct module, a
pool of pytest tests (each tagged with the seeded bugs it exposes), and the bugs (one exact
text replacement of the module each, with an issue-style statement).

``{pkg}`` in a module, a test or a statement is the package's name (drawn per instance).
Every bug's replacement must occur exactly once in its module; the tests tagged with a bug
fail with it and pass without it; every other test passes with it (checked over the whole
generated set: ``tests/domains/test_repo_generate.py``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Bug:
    name: str
    kind: str  # off_by_one | wrong_operator | missing_edge_case
    find: str
    replace: str
    statements: tuple[str, ...]


@dataclass(frozen=True)
class Template:
    name: str
    module: str  # the file name inside the package
    packages: tuple[str, ...]
    source: str
    tests: tuple[tuple[str, str, tuple[str, ...]], ...]  # (name, body, bugs it exposes)
    bugs: tuple[Bug, ...]
    readme: str


STRINGS = Template(
    name="strings", module="text.py",
    packages=("textkit", "strtools", "wordsmith", "stringly", "letterbox", "inkwell"),
    readme="Small string helpers: truncate, slugify, is_palindrome, wrap.",
    source='''"""Small string helpers."""


def truncate(text, width, suffix="..."):
    """Cut text to at most width characters, ending with suffix when it was cut."""
    if len(text) <= width:
        return text
    if width <= len(suffix):
        return suffix[:width]
    return text[: width - len(suffix)] + suffix


def slugify(text):
    """Lower-case words joined by '-'; anything not a letter or digit separates words."""
    words = []
    current = ""
    for ch in text.lower():
        if ch.isalnum():
            current += ch
        elif current:
            words.append(current)
            current = ""
    if current:
        words.append(current)
    return "-".join(words)


def is_palindrome(text):
    """True when text reads the same backwards, ignoring case and non-alphanumerics."""
    cleaned = [ch.lower() for ch in text if ch.isalnum()]
    return cleaned == cleaned[::-1]


def wrap(text, width):
    """Greedy word wrap: lines of at most width characters (a longer word stays whole)."""
    lines, line = [], ""
    for word in text.split():
        if not line:
            line = word
        elif len(line) + 1 + len(word) <= width:
            line += " " + word
        else:
            lines.append(line)
            line = word
    if line:
        lines.append(line)
    return lines
''',
    tests=(
        ("test_truncate_short_text_unchanged", 'assert truncate("hi", 10) == "hi"', ()),
        ("test_truncate_exact_width_unchanged", 'assert truncate("abcde", 5) == "abcde"',
         ("truncate_boundary",)),
        ("test_truncate_length_is_width",
         'out = truncate("hello world", 8)\n    assert out == "hello..." and len(out) == 8',
         ("truncate_length",)),
        ("test_truncate_tiny_width", 'assert truncate("hello", 2) == ".."', ()),
        ("test_slugify_single_word", 'assert slugify("one-") == "one"', ()),
        ("test_slugify_words", 'assert slugify("Hello, World") == "hello-world"',
         ("slug_last_word",)),
        ("test_slugify_separators", 'assert slugify("a  b") == "a-b"', ("slug_last_word",)),
        ("test_palindrome_plain", 'assert is_palindrome("Level")', ()),
        ("test_palindrome_not", 'assert not is_palindrome("abc")', ()),
        ("test_palindrome_punctuation", 'assert is_palindrome("A man, a plan, a canal: Panama")',
         ("palindrome_filter",)),
        ("test_wrap_splits", 'assert wrap("aaa bbb ccc", 8) == ["aaa bbb", "ccc"]', ()),
        ("test_wrap_exact_fit", 'assert wrap("aa bb", 5) == ["aa bb"]', ("wrap_boundary",)),
        ("test_wrap_long_word", 'assert wrap("abcdefgh xy", 4) == ["abcdefgh", "xy"]', ()),
    ),
    bugs=(
        Bug("truncate_boundary", "off_by_one", "if len(text) <= width:", "if len(text) < width:",
            ("`{pkg}.text.truncate` cuts text that already fits: `truncate(\"abcde\", 5)` "
             "returns `\"ab...\"` instead of `\"abcde\"`.",
             "truncate() shortens a string whose length equals the width; such a string "
             "should come back unchanged.")),
        Bug("truncate_length", "off_by_one", "text[: width - len(suffix)] + suffix",
            "text[: width - len(suffix) + 1] + suffix",
            ("`truncate(\"hello world\", 8)` returns 9 characters (`\"hello ...\"`); the "
             "result must never be longer than the width.",
             "{pkg}: the output of truncate is one character longer than `width` when the "
             "text is cut.")),
        Bug("slug_last_word", "missing_edge_case",
            "    if current:\n        words.append(current)\n    return \"-\".join(words)",
            "    return \"-\".join(words)",
            ("`slugify(\"Hello, World\")` returns `\"hello\"`: the last word is dropped unless "
             "the text ends with a separator.",
             "{pkg}.text.slugify loses the final word of its input (`slugify(\"a  b\")` gives "
             "`\"a\"`, expected `\"a-b\"`).")),
        Bug("palindrome_filter", "wrong_operator", "for ch in text if ch.isalnum()]",
            "for ch in text if ch != \" \"]",
            ("is_palindrome should ignore punctuation: `is_palindrome(\"A man, a plan, a "
             "canal: Panama\")` is False but must be True.",
             "{pkg}: is_palindrome only skips spaces; commas and colons make real "
             "palindromes fail.")),
        Bug("wrap_boundary", "off_by_one", "len(line) + 1 + len(word) <= width",
            "len(line) + 1 + len(word) < width",
            ("`wrap(\"aa bb\", 5)` returns `[\"aa\", \"bb\"]`, but `\"aa bb\"` is 5 characters "
             "and fits in one line of width 5.",
             "{pkg}.text.wrap breaks a line that would be exactly `width` characters long.")),
    ),
)

INTERVALS = Template(
    name="intervals", module="calc.py",
    packages=("spans", "timeline", "rangekit", "calendarx", "periods", "datespan"),
    readme="Closed integer intervals and calendar dates: overlaps, merge, leap years, add_days.",
    source='''"""Closed intervals (start, end) of integers, and dates (year, month, day)."""


def overlaps(a, b):
    """True when the closed intervals a and b share at least one point."""
    return a[0] <= b[1] and b[0] <= a[1]


def merge(intervals):
    """The union of closed intervals, as sorted disjoint intervals."""
    if not intervals:
        return []
    ordered = sorted(intervals)
    merged = [list(ordered[0])]
    for start, end in ordered[1:]:
        last = merged[-1]
        if start <= last[1]:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return [tuple(m) for m in merged]


def is_leap(year):
    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)


def days_in_month(year, month):
    if month == 2:
        return 29 if is_leap(year) else 28
    return 30 if month in (4, 6, 9, 11) else 31


def add_days(date, days):
    """The date days (>= 0) after date."""
    year, month, day = date
    for _ in range(days):
        day += 1
        if day > days_in_month(year, month):
            day = 1
            month += 1
            if month > 12:
                month = 1
                year += 1
    return (year, month, day)
''',
    tests=(
        ("test_overlap_inside", "assert overlaps((1, 5), (2, 3))", ()),
        ("test_overlap_disjoint", "assert not overlaps((1, 2), (4, 5))", ()),
        ("test_overlap_touching", "assert overlaps((1, 3), (3, 6))", ("overlap_touch",)),
        ("test_merge_two", "assert merge([(5, 8), (1, 3)]) == [(1, 3), (5, 8)]", ()),
        ("test_merge_overlapping", "assert merge([(1, 4), (3, 6)]) == [(1, 6)]", ()),
        ("test_merge_contained", "assert merge([(1, 10), (2, 3)]) == [(1, 10)]",
         ("merge_contained",)),
        ("test_merge_empty", "assert merge([]) == []", ("merge_empty",)),
        ("test_leap_common", "assert is_leap(2024) and not is_leap(2023)", ()),
        ("test_leap_century", "assert not is_leap(1900)", ()),
        ("test_leap_400", "assert is_leap(2000)", ("leap_400",)),
        ("test_days_in_february", "assert days_in_month(2023, 2) == 28", ()),
        ("test_days_in_november", "assert days_in_month(2023, 11) == 30", ("november",)),
        ("test_add_days_same_month", "assert add_days((2023, 1, 1), 9) == (2023, 1, 10)", ()),
        ("test_add_days_year_end", "assert add_days((2023, 12, 31), 1) == (2024, 1, 1)", ()),
    ),
    bugs=(
        Bug("overlap_touch", "wrong_operator", "return a[0] <= b[1] and b[0] <= a[1]",
            "return a[0] < b[1] and b[0] < a[1]",
            ("`overlaps((1, 3), (3, 6))` is False, but closed intervals that share an "
             "endpoint overlap.",
             "{pkg}.calc.overlaps: intervals touching at one point are reported as "
             "disjoint.")),
        Bug("merge_contained", "wrong_operator", "last[1] = max(last[1], end)", "last[1] = end",
            ("`merge([(1, 10), (2, 3)])` returns `[(1, 3)]`: an interval inside another "
             "shrinks the union.",
             "{pkg}: merging an interval contained in the previous one cuts the result "
             "short.")),
        Bug("merge_empty", "missing_edge_case", "    if not intervals:\n        return []\n",
            "",
            ("`merge([])` raises IndexError; the union of no intervals is `[]`.",
             "{pkg}.calc.merge crashes on an empty list.")),
        Bug("leap_400", "missing_edge_case", "(year % 100 != 0 or year % 400 == 0)",
            "year % 100 != 0",
            ("`is_leap(2000)` is False; years divisible by 400 are leap years.",
             "{pkg}: 2000 is treated as a common year, so February 2000 has 28 days.")),
        Bug("november", "missing_edge_case", "month in (4, 6, 9, 11)", "month in (4, 6, 9)",
            ("`days_in_month(2023, 11)` returns 31; November has 30 days.",
             "{pkg}.calc: adding days across the end of November skips December 1st.")),
    ),
)

STACKS = Template(
    name="stacks", module="structures.py",
    packages=("containers", "stackq", "pilekit", "bufferlib", "fifolifo", "heapish"),
    readme="A stack, a fixed-capacity ring queue, and a bracket checker built on the stack.",
    source='''"""A stack, a fixed-capacity ring queue, and a bracket checker."""


class Stack:
    def __init__(self):
        self._items = []

    def push(self, item):
        self._items.append(item)

    def pop(self):
        if not self._items:
            raise IndexError("pop from an empty stack")
        return self._items.pop()

    def peek(self):
        if not self._items:
            raise IndexError("peek at an empty stack")
        return self._items[-1]

    def __len__(self):
        return len(self._items)


class RingQueue:
    """A FIFO queue of at most capacity items in a fixed buffer."""

    def __init__(self, capacity):
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self._buf = [None] * capacity
        self._head = 0
        self._size = 0

    def enqueue(self, item):
        if self._size == len(self._buf):
            raise OverflowError("the queue is full")
        self._buf[(self._head + self._size) % len(self._buf)] = item
        self._size += 1

    def dequeue(self):
        if self._size == 0:
            raise IndexError("dequeue from an empty queue")
        item = self._buf[self._head]
        self._buf[self._head] = None
        self._head = (self._head + 1) % len(self._buf)
        self._size -= 1
        return item

    def is_full(self):
        return self._size == len(self._buf)

    def __len__(self):
        return self._size


PAIRS = {")": "(", "]": "[", "}": "{"}


def balanced(text):
    """True when every bracket of text is closed in the right order."""
    stack = Stack()
    for ch in text:
        if ch in "([{":
            stack.push(ch)
        elif ch in PAIRS:
            if not len(stack) or stack.pop() != PAIRS[ch]:
                return False
    return len(stack) == 0
''',
    tests=(
        ("test_stack_lifo",
         "s = Stack()\n    s.push(1)\n    s.push(2)\n    assert s.pop() == 2 and s.pop() == 1", ()),
        ("test_stack_peek",
         "s = Stack()\n    s.push(1)\n    s.push(2)\n    assert s.peek() == 2 and len(s) == 2",
         ("peek_top",)),
        ("test_stack_empty_pop",
         "with pytest.raises(IndexError):\n        Stack().pop()", ()),
        ("test_queue_fifo",
         "q = RingQueue(3)\n    q.enqueue(1)\n    q.enqueue(2)\n"
         "    assert q.dequeue() == 1 and q.dequeue() == 2", ()),
        ("test_queue_wraps",
         "q = RingQueue(2)\n    q.enqueue(1)\n    q.enqueue(2)\n    assert q.dequeue() == 1\n"
         "    q.enqueue(3)\n    assert q.dequeue() == 2 and q.dequeue() == 3",
         ("enqueue_wrap", "dequeue_wrap")),
        ("test_queue_full",
         "q = RingQueue(1)\n    q.enqueue(1)\n    assert q.is_full()\n"
         "    with pytest.raises(OverflowError):\n        q.enqueue(2)", ()),
        ("test_queue_not_full", "q = RingQueue(2)\n    q.enqueue(1)\n    assert not q.is_full()",
         ("is_full",)),
        ("test_balanced_ok", 'assert balanced("([]{})") and balanced("")', ()),
        ("test_balanced_wrong_order", 'assert not balanced("(]")', ()),
        ("test_balanced_unclosed", 'assert not balanced("((")', ("unclosed",)),
    ),
    bugs=(
        Bug("peek_top", "off_by_one", "return self._items[-1]", "return self._items[0]",
            ("`Stack.peek()` returns the bottom item instead of the top one.",
             "{pkg}.structures.Stack: after push(1), push(2), peek() gives 1, but pop() "
             "gives 2.")),
        Bug("enqueue_wrap", "missing_edge_case",
            "self._buf[(self._head + self._size) % len(self._buf)] = item",
            "self._buf[self._head + self._size] = item",
            ("RingQueue.enqueue raises IndexError once the queue has wrapped around its "
             "buffer, even though it is not full.",
             "{pkg}: RingQueue(2): enqueue 1, 2, dequeue, enqueue 3 crashes with IndexError.")),
        Bug("dequeue_wrap", "missing_edge_case",
            "self._head = (self._head + 1) % len(self._buf)", "self._head = self._head + 1",
            ("RingQueue.dequeue fails after the head passes the end of the buffer.",
             "{pkg}.structures: a RingQueue of capacity 2 cannot dequeue its third item.")),
        Bug("is_full", "wrong_operator", "return self._size == len(self._buf)",
            "return self._size >= len(self._buf) - 1",
            ("`RingQueue.is_full()` is True when one slot is still free.",
             "{pkg}: RingQueue(2) with one item says it is full.")),
        Bug("unclosed", "missing_edge_case", "    return len(stack) == 0", "    return True",
            ("`balanced(\"((\")` is True: unclosed brackets are not reported.",
             "{pkg}.structures.balanced accepts text whose brackets are never closed.")),
    ),
)

PARSER = Template(
    name="parser", module="parse.py",
    packages=("confparse", "exprkit", "tinyparse", "lexis", "calcparse", "kvread"),
    readme="Parsers: key = value config text, integer ranges such as '1, 3-5', and integer "
           "arithmetic expressions.",
    source='''"""Small parsers: key = value text, integer lists with ranges, arithmetic."""


def parse_kv(text):
    """'key = value' lines to a dict; '#' starts a comment; blank lines are skipped."""
    out = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        if "=" not in line:
            raise ValueError(f"line {number}: expected key = value")
        key, value = line.split("=", 1)
        out[key.strip()] = value.strip()
    return out


def parse_ints(text):
    """'1, 3-5' to [1, 3, 4, 5]; empty parts are skipped."""
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            out.extend(range(int(lo), int(hi) + 1))
        else:
            out.append(int(part))
    return out


def tokenize(expr):
    tokens, i = [], 0
    while i < len(expr):
        ch = expr[i]
        if ch.isspace():
            i += 1
        elif ch.isdigit():
            j = i
            while j < len(expr) and expr[j].isdigit():
                j += 1
            tokens.append(int(expr[i:j]))
            i = j
        elif ch in "+-*()":
            tokens.append(ch)
            i += 1
        else:
            raise ValueError(f"unexpected character {ch!r} at {i}")
    return tokens


def evaluate(expr):
    """The value of an integer expression with + - * and parentheses."""
    tokens = tokenize(expr)
    pos = 0

    def peek():
        return tokens[pos] if pos < len(tokens) else None

    def take():
        nonlocal pos
        pos += 1
        return tokens[pos - 1]

    def expression():
        value = term()
        while peek() in ("+", "-"):
            op = take()
            rhs = term()
            value = value + rhs if op == "+" else value - rhs
        return value

    def term():
        value = factor()
        while peek() == "*":
            take()
            value = value * factor()
        return value

    def factor():
        tok = peek()
        if tok == "(":
            take()
            value = expression()
            if peek() != ")":
                raise ValueError("missing )")
            take()
            return value
        if isinstance(tok, int):
            return take()
        raise ValueError(f"unexpected token {tok!r}")

    value = expression()
    if pos != len(tokens):
        raise ValueError("unexpected tokens after the expression")
    return value
''',
    tests=(
        ("test_kv_basic", 'assert parse_kv("a = 1\\n\\nb=2") == {"a": "1", "b": "2"}', ()),
        ("test_kv_comment", 'assert parse_kv("a = 1  # one") == {"a": "1"}', ()),
        ("test_kv_value_with_equals", 'assert parse_kv("url = x=y") == {"url": "x=y"}',
         ("kv_split",)),
        ("test_kv_error_line",
         'with pytest.raises(ValueError, match="line 2"):\n        parse_kv("a = 1\\noops")',
         ("kv_line",)),
        ("test_ints_single", 'assert parse_ints("4, 2") == [4, 2]', ()),
        ("test_ints_range", 'assert parse_ints("1, 3-5") == [1, 3, 4, 5]', ("range_end",)),
        ("test_ints_trailing_comma", 'assert parse_ints("1, 2,") == [1, 2]', ("ints_empty",)),
        ("test_eval_precedence", 'assert evaluate("2 + 3 * 4") == 14', ()),
        ("test_eval_parens", 'assert evaluate("(2 + 3) * 4") == 20', ()),
        ("test_eval_multi_digit", 'assert evaluate("12 + 30") == 42', ("multi_digit",)),
        ("test_eval_subtract", 'assert evaluate("9 - 3 - 1") == 5', ("subtract",)),
        ("test_eval_trailing",
         'with pytest.raises(ValueError):\n        evaluate("1 2")', ("trailing",)),
    ),
    bugs=(
        Bug("kv_split", "missing_edge_case", 'key, value = line.split("=", 1)',
            'key, value = line.split("=")',
            ("`parse_kv(\"url = x=y\")` raises ValueError: a value that contains `=` cannot "
             "be parsed.",
             "{pkg}.parse.parse_kv fails on values holding an equals sign.")),
        Bug("kv_line", "off_by_one", "enumerate(text.splitlines(), 1)",
            "enumerate(text.splitlines())",
            ("The error of parse_kv names the wrong line: a bad second line is reported as "
             "`line 1`.",
             "{pkg}: parse_kv's line numbers in errors are 0-based; they should start at 1.")),
        Bug("range_end", "off_by_one", "range(int(lo), int(hi) + 1)", "range(int(lo), int(hi))",
            ("`parse_ints(\"3-5\")` gives `[3, 4]`; ranges include their end.",
             "{pkg}.parse.parse_ints drops the last number of every range.")),
        Bug("ints_empty", "missing_edge_case", "        if not part:\n            continue\n",
            "",
            ("`parse_ints(\"1, 2,\")` raises ValueError; empty parts should be skipped.",
             "{pkg}: a trailing comma makes parse_ints crash.")),
        Bug("multi_digit", "off_by_one", "while j < len(expr) and expr[j].isdigit():",
            "while j < len(expr) and expr[j].isdigit() and j == i:",
            ("`evaluate(\"12 + 30\")` fails: numbers with more than one digit are not read.",
             "{pkg}.parse.tokenize splits 12 into 1 and 2.")),
        Bug("subtract", "wrong_operator", "value = value + rhs if op == \"+\" else value - rhs",
            "value = value + rhs if op == \"+\" else rhs - value",
            ("`evaluate(\"9 - 3 - 1\")` is wrong: subtraction has its operands swapped.",
             "{pkg}: evaluate(\"10 - 3\") returns -7.")),
        Bug("trailing", "missing_edge_case",
            "    if pos != len(tokens):\n        raise ValueError(\"unexpected tokens after the "
            "expression\")\n", "",
            ("`evaluate(\"1 2\")` returns 1 instead of raising ValueError for the extra token.",
             "{pkg}.parse.evaluate ignores whatever follows a complete expression.")),
    ),
)

TEMPLATES: tuple[Template, ...] = (STRINGS, INTERVALS, STACKS, PARSER)
