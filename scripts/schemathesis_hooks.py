"""Schemathesis hooks for a bounded fuzz run of `selfdraft serve` (the real model, on a CPU).

Every request sent asks for at most 4 new tokens, so a run of hundreds of cases takes minutes, not
hours: the length field the server reads (chat's `max_completion_tokens` when set, else `max_tokens`)
becomes 4 when it is missing, null or above 4. Nothing else is touched, so invalid values (0, -1,
strings, floats) still reach the server. `before_call` runs in every phase (the coverage phase
does not go through the map_* hooks).

    SCHEMATHESIS_HOOKS=scripts/schemathesis_hooks.py st run http://127.0.0.1:8000/openapi.json ...
"""

import schemathesis

CAP = 4


@schemathesis.hook
def before_call(context, case, kwargs):
    body = case.body
    if not (isinstance(body, dict) and ("prompt" in body or "messages" in body)):
        return
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    value = body.get(key)
    if value is None or (type(value) is int and value > CAP):
        body[key] = CAP
