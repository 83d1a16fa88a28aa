"""JSON extraction with a schema: every output is valid JSON that matches the schema, whatever the
model would have written unconstrained.

python examples/json_extraction.py [--url URL]
"""

from __future__ import annotations

import argparse
import json

import radixlm as sgl

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 32},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "city": {"type": "string"},
        "occupation": {"type": "string"},
        "is_student": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "occupation", "is_student"],
}
TEXTS = [
    "Maria Lopez is a 34-year-old architect who lives in Madrid.",
    "Tom, 19, studies physics at the university in Boston.",
    "Retired teacher Ana Silva, aged 67, moved to Lisbon last year.",
]


@sgl.function
def extract(s, text):
    s += sgl.system("Extract the person described in the text as JSON.")
    s += sgl.user(text)
    s += sgl.assistant(sgl.gen("person", max_tokens=96, json_schema=SCHEMA))


def run(backend) -> list[dict]:
    states = extract.run_batch([{"text": t} for t in TEXTS], backend=backend, temperature=0)
    return [json.loads(s["person"]) for s in states]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running radixlm server; default: start one locally")
    args = parser.parse_args()
    backend = sgl.RuntimeEndpoint(args.url) if args.url else sgl.Runtime()
    try:
        for text, person in zip(TEXTS, run(backend)):
            print(text, "->", json.dumps(person))
    finally:
        backend.shutdown()


if __name__ == "__main__":
    main()
