"""What a prompt is about: its domain (code or chat) and its cluster, for acceptance-aware selection.

Owns the tagger. Promises: `tag_prompt` is a pure function of the prompt's system and user text
(the same text dedupe reads), the same on every machine and run; every prompt gets exactly one
cluster of `CLUSTERS`, and its domain follows from it (`code` for the code cluster, else `chat`).

The clusters are rules, not fitted centroids, on purpose: a nightly discover tags new prompts
without refitting anything, a tag never moves when the catalog grows, and the reason lineage gives
for choosing a prompt ("cluster math: the draft accepts 1.31 there against 1.52 overall") reads
as something a person can check. They split the prompts where a draft's acceptance is known to
differ: code, arithmetic and formulas, text that is mostly not Latin-script English, requests for
long-form writing, and the rest. `TAGGER` names the rules; change it when they change, and a
discover re-tags every stored prompt.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

TAGGER = "rules-v1"
DOMAINS = ("code", "chat")
CLUSTERS = ("code", "math", "multilingual", "writing", "general")

# A prompt is tagged by its opening: long pasted documents cost regex time, not information.
_READ_CHARS = 2000
# Each signal is a pattern whose hits are counted: code and math need two.
_CODE = re.compile(
    r"```|^\s*(?:def|class|import|from \S+ import|#include|public (?:static )?\w+|function\b|const |let |var |"
    r"CREATE TABLE|<\?php|package \w+|fn \w+\(|using namespace)"
    r"|\bSELECT\b[^;\n]{0,120}\bFROM\b|\bINSERT INTO\b|\bUPDATE \w+ SET\b"
    r"|\b(?:python|javascript|typescript|java|c\+\+|c#|golang|rust|sql|html|css|react|vue|angular|django|flask|"
    r"pandas|numpy|pytorch|tensorflow|node\.?js|next\.?js|tailwind\w*|lua|luau|php|ruby|kotlin|swift|unity|"
    r"docker|kubernetes|git|linux|regex|api|json|yaml|bash|powershell|shell script|compile[rd]?|debug\w*|"
    r"stack trace|traceback|function|variable|array|algorithm|code|programm\w*|syntax error|exception|"
    r"frontend|backend|database|npm|pip install)\b"
    r"|[a-z_]\w*\([^()\n]*\)\s*[{;:]|\w+\.\w+\([^()\n]*\)|==|!=|=>|->|&&|\|\|",
    re.IGNORECASE | re.MULTILINE,
)
_MATH = re.compile(
    r"\d+(?:\.\d+)?\s*[+*/^×÷]\s*\(?\d+|\d\s*=\s*-?\d|\\frac|\\sqrt|\b[a-z]\^\d|\b\d*[a-z]\s*[+=]\s*\d"
    r"|\b(?:solve|calculate|equations?|integral|derivative|probability|algebra\w*|geometry|arithmetic|"
    r"theorem|prove that|polynomial|quadratic|matrix|vectors?|percentage of|how many \w+ (?:are|is|does|will))\b",
    re.IGNORECASE,
)
_WRITING = re.compile(
    r"\b(?:write|compose|draft|rewrite|paraphrase)\b[^.?!\n]{0,40}?\b(?:story|poem|essay|letter|email|e-mail|"
    r"article|blog|post|song|lyrics|speech|script|tweet|caption|description|cover letter|review|summary|"
    r"paragraph|ad|advertisement|slogan|product description)s?\b"
    r"|\b(?:short story|haiku|sonnet|limerick|rap|screenplay)\b",
    re.IGNORECASE,
)


def domain_of(cluster: str) -> str:
    return "code" if cluster == "code" else "chat"


@dataclass(frozen=True)
class PromptTag:
    domain: str
    cluster: str
    signals: str  # why: the hits that decided it, for lineage


def tag_prompt(text: str) -> PromptTag:
    """The cluster of a prompt's text, first match in this order: code, multilingual, math, writing,
    general. Code comes first because code questions are often written in other languages and
    carry arithmetic; multilingual before math and writing for the same reason."""
    text = text[:_READ_CHARS]
    code = len(_CODE.findall(text))
    if code >= 2:
        return PromptTag("code", "code", f"{code} code signals")
    letters = [c for c in text if c.isalpha()]
    other = sum(1 for c in letters if not c.isascii())
    if letters and other / len(letters) >= 0.3:
        return PromptTag("chat", "multilingual", f"{other / len(letters):.0%} of letters outside ASCII")
    math = len(_MATH.findall(text))
    if math >= 2:
        return PromptTag("chat", "math", f"{math} math signals")
    if _WRITING.search(text):
        return PromptTag("chat", "writing", "asks for long-form writing")
    return PromptTag("chat", "general", "no other cluster's signals")


def tag_untagged(store, batch: int = 50_000) -> int:
    """Tag every stored prompt the current `TAGGER` has not tagged (new prompts after a discover, all
    of them after an upgrade or a change of rules); returns how many. Batches of `batch` prompts,
    each its own transaction: an interrupted run keeps what it tagged and the next one goes on."""
    from tasks.discover.prompts import prompt_text

    done = 0
    while True:
        todo = store.selection.untagged_prompts(TAGGER, limit=batch)
        if not todo:
            return done
        rows = []
        for prompt_id, messages in todo:
            t = tag_prompt(prompt_text(messages))
            rows.append((prompt_id, t.domain, t.cluster, t.signals))
        done += store.selection.write_tags(TAGGER, rows)
