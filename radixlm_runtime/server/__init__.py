"""The HTTP server: an asyncio front end (tokenizer manager, FastAPI) and a scheduler process."""
