"""The server: args, launch, OpenAI-compatible API, interactive shell."""
