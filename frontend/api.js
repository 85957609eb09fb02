// HTTP access to the server (server/PROTOCOL.md, "HTTP"). The access token, when one
// is in force, comes in the start-up URL (`#token=T`, or `?token=T` from scripts),
// is taken out of the address bar at once and kept in sessionStorage: scoped to this
// origin, port included, so no other server on the same host ever sees it (a cookie
// would reach them all). It is sent as `Authorization: Bearer T`, and on the
// websocket as a subprotocol (a browser cannot set headers there; see ws.js).

const TOKEN_KEY = "gradient-inspector.token";
let token = null;

function stored() {
  try {
    return window.sessionStorage.getItem(TOKEN_KEY);
  } catch {
    return null; // storage disabled: the token lives in memory only
  }
}

/** Take `#token=` or `?token=` out of the address bar (without a reload); keep it for this tab. */
export function takeTokenFromUrl() {
  const url = new URL(window.location.href);
  const hash = new URLSearchParams(url.hash.slice(1));
  const t = hash.get("token") ?? url.searchParams.get("token");
  if (t !== null) {
    token = t;
    try {
      window.sessionStorage.setItem(TOKEN_KEY, t);
    } catch {
      // storage disabled: kept in memory (a reload then needs the URL again)
    }
    hash.delete("token");
    url.searchParams.delete("token");
    const rest = hash.toString();
    window.history.replaceState(
      window.history.state,
      "",
      url.pathname + url.search + (rest ? `#${rest}` : ""),
    );
  } else {
    token = stored();
  }
}

/** The websocket subprotocols that carry the token: ours, and `gi-token.HEX` (UTF-8 bytes in hex). */
export function socketProtocols() {
  if (!token) return [];
  const hex = Array.from(new TextEncoder().encode(token), (b) => b.toString(16).padStart(2, "0")).join("");
  return ["gradient-inspector", `gi-token.${hex}`];
}

function headers(extra = {}) {
  const h = { Accept: "application/json", ...extra };
  if (token) h.Authorization = `Bearer ${token}`;
  return h;
}

function query(params) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params || {})) {
    if (v !== undefined && v !== null && v !== "") q.set(k, String(v));
  }
  const s = q.toString();
  return s ? `?${s}` : "";
}

/**
 * The outcome of a request: {ok, status, data}. `data` is the parsed JSON body
 * (for errors, the server's `{"detail": ...}`); a network failure is status 0.
 */
async function request(method, path, { params, body, accept } = {}) {
  const init = { method, headers: headers(accept ? { Accept: accept } : {}), credentials: "omit" };
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  let res;
  try {
    res = await fetch(path + query(params), init);
  } catch (err) {
    return { ok: false, status: 0, data: { detail: `network error: ${err.message}` } };
  }
  let data = null;
  const type = res.headers.get("content-type") || "";
  if (res.status !== 204) {
    data = type.includes("json") ? await res.json().catch(() => null) : await res.text();
  }
  return { ok: res.ok, status: res.status, data };
}

export const api = {
  session: (run) => request("GET", "/api/session", { params: { run } }),
  targets: (glob, point) => request("GET", "/api/targets", { params: { glob, point } }),
  hooks: () => request("GET", "/api/hooks"),
  addHook: (spec) => request("POST", "/api/hooks", { body: spec }),
  updateHook: (id, patch) => request("PATCH", `/api/hooks/${encodeURIComponent(id)}`, { body: patch }),
  removeHook: (id) => request("DELETE", `/api/hooks/${encodeURIComponent(id)}`),
  exportHooks: () => request("GET", "/api/hooks/export"),
  exportPython: () =>
    request("GET", "/api/hooks/export", { params: { format: "python" }, accept: "text/plain" }),
  importHooks: (preset) => request("POST", "/api/hooks/import", { body: preset }),
  training: (action) => request("POST", `/api/training/${action}`),
  rate: (stepsPerSecond) =>
    request("POST", "/api/training/rate", { body: { steps_per_second: stepsPerSecond } }),
  // detail=false: a large run's rows come without per-tensor lists (the page asks for those it
  // follows with `detail`); a small run's rows are whole either way
  snapshots: ({ since, until, limit, points, buckets, run } = {}) =>
    request("GET", "/api/snapshots", {
      params: { since, until, limit, points, buckets, run, detail: "false" },
    }),
  scalars: ({ since, until, limit, points, buckets, run } = {}) =>
    request("GET", "/api/scalars", { params: { since, until, limit, points, buckets, run } }),
  events: ({ since, run } = {}) => request("GET", "/api/events", { params: { since, run } }),
  detail: ({ params, run, since, limit } = {}) =>
    request("GET", "/api/detail", { params: { params: (params || []).join(","), run, since, limit } }),
  runs: () => request("GET", "/api/runs"),
  checkpoints: () => request("GET", "/api/checkpoints"),
  checkpoint: (label = null) => request("POST", "/api/checkpoints", { body: label ? { label } : {} }),
  // skip: "since_checkpoint" (the batches received since the checkpoint are not received again)
  rewind: (id, skip = null) =>
    request("POST", `/api/checkpoints/${encodeURIComponent(id)}/rewind`, skip ? { body: { skip } } : {}),
  shadow: () => request("GET", "/api/shadow"),
  startShadow: () => request("POST", "/api/shadow"),
  stopShadow: () => request("DELETE", "/api/shadow"),
  // the flight recorder and spike detection (flight.js)
  spikes: () => request("GET", "/api/spikes"),
  setSpikes: (change) => request("PUT", "/api/spikes", { body: change }),
  flight: ({ run, since, until } = {}) => request("GET", "/api/flight", { params: { run, since, until } }),
  flightNow: () => request("POST", "/api/flight"),
  // rules for unattended runs (rules.js); addRule also takes {preset: name}
  rules: () => request("GET", "/api/rules"),
  addRule: (rule) => request("POST", "/api/rules", { body: rule }),
  updateRule: (id, patch) => request("PATCH", `/api/rules/${encodeURIComponent(id)}`, { body: patch }),
  removeRule: (id) => request("DELETE", `/api/rules/${encodeURIComponent(id)}`),
};

/**
 * A server `detail` as a list of {loc, msg}: a string detail becomes one entry
 * with an empty loc.
 */
export function detailList(data) {
  const d = data && data.detail !== undefined ? data.detail : data;
  if (Array.isArray(d)) {
    return d.map((e) => ({ loc: Array.isArray(e.loc) ? e.loc.map(String) : [], msg: String(e.msg ?? e) }));
  }
  return [{ loc: [], msg: typeof d === "string" ? d : JSON.stringify(d) }];
}

/** One entry of a detail as text: "loc: msg", or just the message when it names no field. */
export function detailText(d) {
  return d.loc.length ? `${d.loc.join(".")}: ${d.msg}` : d.msg;
}

/**
 * A failed request's detail as one line for the page, entries joined by "; ".
 * `res` is a request's outcome ({data}); a websocket `error` message carries its
 * `detail` the same way, as `{data: msg}`.
 */
export function errorText(res) {
  return detailList(res.data).map(detailText).join("; ");
}
