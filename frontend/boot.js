// The page's first request, made before anything else of the page runs: the websocket (its
// `hello` brings the session and the newest history) is opened while the browser still loads and
// runs plotly.js and the page's modules, so the server builds the hello meanwhile. ws.js's
// Connection takes this socket over on its first connection, with what it received until then.
// A classic script (no module: it runs where it stands, before the deferred scripts); it reads
// the access token as api.js does (`#token=`, `?token=`, else this tab's sessionStorage), and
// leaves the address bar to api.js.
(() => {
  let token = null;
  try {
    const url = new URL(window.location.href);
    token = new URLSearchParams(url.hash.slice(1)).get("token") ?? url.searchParams.get("token");
    if (token === null) token = window.sessionStorage.getItem("gradient-inspector.token");
  } catch {
    token = null; // storage disabled: no token then, as api.js
  }
  const hex = (t) => Array.from(new TextEncoder().encode(t), (b) => b.toString(16).padStart(2, "0")).join("");
  const protocols = token ? ["gradient-inspector", `gi-token.${hex(token)}`] : [];
  const url = `${window.location.protocol === "https:" ? "wss:" : "ws:"}//${window.location.host}/ws`;
  let socket;
  try {
    socket = new WebSocket(url, protocols);
  } catch {
    return; // the Connection opens its own
  }
  const early = { socket, url, opened: false, messages: [], closed: null };
  const listeners = {
    open: () => (early.opened = true),
    message: (ev) => early.messages.push(ev),
    close: (ev) => (early.closed = ev),
  };
  for (const [kind, fn] of Object.entries(listeners)) socket.addEventListener(kind, fn);
  early.detach = () => {
    for (const [kind, fn] of Object.entries(listeners)) socket.removeEventListener(kind, fn);
  };
  window.__giEarlySocket = early;
})();
