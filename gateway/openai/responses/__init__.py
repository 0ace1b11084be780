"""The OpenAI Responses API (`/v1/responses`) over the chat path, stored per tenant."""
