"""A prompt-lookup offer priced by the length of its match.

How far a lookup's drafts hold follows how long the text behind the match agrees with the text
being written (prompt_lookup.match_length): a 4-token agreement is a coincidence as often as
not, one of 32 is a copy under way. On the target's own greedy text of six prompts (two runs
each, 200 tokens, 15 drafts per offer; docs/journal.md, "Long matches priced as a copy"), of an
offer's 15 drafts were kept on average: 1.9 after a match of 4 tokens, 3.1 after 5-7, 6.4 after
8-15, 12.8 after 16-31 and 14.0 after 32 or more; as per-token acceptances of the geometric
model (allocator.plan: sum_{j=1..15} a**j = kept) 0.66, 0.76, 0.88, 0.98 and 0.99. Only the last
two are the prior here: below 16 tokens the rows of the table moved the plans of code and prose
either way for nothing overall (docs/journal.md, "A copy priced by its match"), and the row's
own prior stays. That is a property of text, not of a machine, and a row's own lookups still
decide (the table is the prior of the row's Beta estimate, AcceptanceTracker.estimate): a row
whose copies keep breaking (a rename) prices its next one by what it saw.

A copy under way (LONG_MATCH tokens or more) may also draft past k_max, up to COPY_K: where a
wider forward costs less a token (a CPU's target: 16 tokens ~8x one, 64 ~24x), a copy's tokens
come cheapest in the widest forward it holds, and the plan (allocator.plan) still picks the k
from the measured costs and the acceptance. The rows a batch pads to the widest pay for it, so
the plan only goes wide where the table and the row's history say the copy holds.
"""

# (shortest match, per-token acceptance), longest first
MATCH_PRIORS = ((32, 0.99), (16, 0.98))
LONG_MATCH = 32
COPY_K = 63
MATCH_CAP = 64  # prompt_lookup.match_length reads no further back than this


def match_prior(match: int) -> float | None:
    """The per-token acceptance an offer after a match of `match` tokens starts from; None below
    the shortest match the table prices (the caller's own prior then)."""
    for shortest, acceptance in MATCH_PRIORS:
        if match >= shortest:
            return acceptance
    return None


def offer_width(k: int, room: int, match: int) -> int:
    """The most drafts a lookup offer may carry: k, or up to COPY_K (within the row's room) once
    its match is a copy under way."""
    return max(k, min(COPY_K, room)) if match >= LONG_MATCH else k
