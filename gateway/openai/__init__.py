"""The OpenAI-compatible API: requests to engine requests, answers, streams, tools, and the
Responses API."""
