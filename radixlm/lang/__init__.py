"""The radixlm language: primitives (ir, api), the interpreter, the tracer, chat templates."""
