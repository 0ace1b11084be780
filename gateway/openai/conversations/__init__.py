"""The OpenAI Conversations API (`/v1/conversations`): conversations and their items, stored
per tenant, that responses read and extend (`conversation` on `POST /v1/responses`)."""
