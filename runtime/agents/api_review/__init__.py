"""The api-review agent: compares two OpenAPI documents for client-breaking changes."""
