"""The OpenAI-compatible HTTP server (`moeserve serve`): see app.py."""
