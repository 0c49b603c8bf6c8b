"""Speculative decoding without a draft model: proposers that guess the next tokens from text already seen,
and the acceptance rules that keep the target model's outputs.

- `ngram.py`    prompt lookup: the continuation of the latest earlier occurrence of the request's last n tokens.
- `suffix.py`   a bounded table of continuations learnt from this request's history and earlier outputs.
- `acceptance.py` greedy acceptance (the longest draft prefix the target agrees with, plus its own token) and
                speculative sampling for temperature > 0 (outputs keep the target distribution).

A verify forward scores a request's draft chain in one pass; what the target rejects is rolled back.
"""
