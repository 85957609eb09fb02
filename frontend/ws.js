// The websocket to /ws, reconnected with exponential backoff (0.5 s doubling to
// 10 s, with jitter) whenever it closes. The owner gets every message and every
// state change. Each connection's URL says what the owner already has (its
// `resume()`: run, step, since, seq), so the server's `hello` brings what was
// missed and nothing twice. The first connection takes over the socket boot.js
// opened before the modules loaded (`takeEarly`), with what it received meanwhile.

import { socketProtocols } from "./api.js";

const BACKOFF_MIN_MS = 500;
const BACKOFF_MAX_MS = 10_000;

/**
 * The socket boot.js opened (window.__giEarlySocket), once, when it is for `url` (a new page's
 * first connection): `{socket, opened, messages, closed}`, its own listeners removed; else null
 * (a socket for another URL is closed).
 */
function takeEarly(url) {
  const early = window.__giEarlySocket;
  if (!early) return null;
  window.__giEarlySocket = undefined;
  early.detach();
  if (early.url === url) return early;
  early.socket.close();
  return null;
}

export class Connection {
  /**
   * @param {{onMessage: (msg) => void, onState: (state, info) => void, resume?: () => object}} handlers
   *   state is "connecting" | "open" | "reconnecting" | "closed"; for
   *   "reconnecting", info.delayMs says when the next try is. `resume` gives the
   *   query of the next connection ({run, step, since, seq}; {} for a new page).
   */
  constructor({ onMessage, onState, resume = () => ({}) }) {
    this.onMessage = onMessage;
    this.onState = onState;
    this.resume = resume;
    this.socket = null;
    this.attempt = 0;
    this.timer = null;
    this.stopped = false;
  }

  url() {
    const proto = window.location.protocol === "https:" ? "wss:" : "ws:";
    const q = new URLSearchParams();
    for (const [k, v] of Object.entries(this.resume()))
      if (Number.isInteger(v) && v >= 0) q.set(k, String(v));
    const s = q.toString();
    return `${proto}//${window.location.host}/ws${s ? `?${s}` : ""}`;
  }

  start() {
    this.stopped = false;
    this.connect();
  }

  stop() {
    this.stopped = true;
    clearTimeout(this.timer);
    if (this.socket) this.socket.close();
    this.onState("closed", {});
  }

  get open() {
    return this.socket !== null && this.socket.readyState === WebSocket.OPEN;
  }

  /** Send a command; false when the socket is not open (the caller may retry later). */
  send(obj) {
    if (!this.open) return false;
    this.socket.send(JSON.stringify(obj));
    return true;
  }

  connect() {
    clearTimeout(this.timer);
    this.onState("connecting", { attempt: this.attempt });
    const early = takeEarly(this.url());
    let socket;
    try {
      // the token travels as a subprotocol (api.js), never in the URL
      socket = early ? early.socket : new WebSocket(this.url(), socketProtocols());
    } catch (err) {
      this.scheduleRetry();
      return;
    }
    this.socket = socket;
    socket.onopen = () => {
      this.attempt = 0;
      this.onState("open", {});
    };
    socket.onmessage = (ev) => {
      let msg;
      try {
        msg = JSON.parse(ev.data);
      } catch {
        return; // the server only sends JSON; ignore anything else
      }
      this.onMessage(msg);
    };
    socket.onclose = (ev) => {
      if (this.socket !== socket) return;
      this.socket = null;
      if (!this.stopped) this.scheduleRetry(ev.code);
    };
    // onerror is always followed by onclose, which does the work.
    socket.onerror = () => {};
    if (early) {
      // What it received before it was taken over, in order, before any later message (a
      // microtask: no task runs in between); from now on the handlers above get the rest.
      queueMicrotask(() => {
        if (early.opened) socket.onopen();
        for (const ev of early.messages) socket.onmessage(ev);
        if (early.closed) socket.onclose(early.closed);
      });
    }
  }

  scheduleRetry(code) {
    const base = Math.min(BACKOFF_MAX_MS, BACKOFF_MIN_MS * 2 ** this.attempt);
    const delayMs = Math.round(base * (0.75 + Math.random() * 0.5));
    this.attempt += 1;
    this.onState("reconnecting", { delayMs, code, attempt: this.attempt });
    this.timer = setTimeout(() => this.connect(), delayMs);
  }
}
