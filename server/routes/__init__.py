"""The routes: HTTP under /api and the websocket /ws."""
