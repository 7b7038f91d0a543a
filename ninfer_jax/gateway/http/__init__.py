"""The HTTP gateway's protocol modules: request parsing, the OpenAI and Anthropic answers,
errors, metrics and the request-to-Engine coupling. `gateway/server.py` assembles the app."""
