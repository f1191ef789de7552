"""The HTTP edge: the server under the app, who may do what (security), limits on what clients
send, TLS, secret-free logs, the OpenAPI document, refusals, metrics and the workers view."""
