// Groups of parameters, for a run with many of them (a large run: more than DETAIL_ALL
// tensors). The server's session carries the partition (`session.groups`: names, members,
// stacks; server/PROTOCOL.md); for a server that sends none, `groupsFor` builds the same
// kind of partition here from the parameter names ("the depth that fits": the tree of
// dotted names expanded from the root, the biggest node first, while at most MAX_GROUPS
// groups). Also: a group's aggregates from full per-parameter lists (a snapshot without
// `groups`), the rows of an expanded group (its modules, then its tensors), the name
// search, and the model signature pins are kept under.

import { num } from "./util.js";

export const DETAIL_ALL = 64; // a run with more tensors is large (the server's DETAIL_ALL)
export const MAX_GROUPS = 60;
const ROOT_GROUP_MAX = 8; // more parameters directly on the root than this: one group "(root)"

/** The aggregate lists of a snapshot's `groups`. */
export const GROUP_KEYS = [
  "norm_raw",
  "norm",
  "absmax_raw",
  "absmax",
  "nan_count",
  "inf_count",
  "norm_min",
  "norm_median",
  "norm_max",
  "ratio_min",
  "ratio_median",
  "ratio_max",
];

const isIndex = (s) => /^\d+$/.test(s);

/** The tree of dotted names: node {path, children: Map, members: [param index], first}. */
function tree(params) {
  const root = { path: "", children: new Map(), members: [], first: 0 };
  params.forEach((name, i) => {
    let node = root;
    node.members.push(i);
    const parts = name.split(".");
    parts.forEach((part, d) => {
      let child = node.children.get(part);
      if (!child) {
        child = { path: parts.slice(0, d + 1).join("."), children: new Map(), members: [], first: i };
        node.children.set(part, child);
      }
      child.members.push(i);
      node = child;
    });
  });
  return root;
}

const isStack = (node) => node.children.size >= 2 && [...node.children.keys()].every(isIndex);

/**
 * The partition of `params` (names, in the Inspector's order) as the server describes it:
 * {source: "tree", names, members, stacks}.
 */
export function buildGroups(params) {
  const root = tree(params);
  let nodes = [];
  const rootLeaves = [...root.children.values()].filter((n) => !n.children.size);
  if (rootLeaves.length > ROOT_GROUP_MAX) {
    const members = rootLeaves.flatMap((n) => n.members);
    nodes.push({ path: "(root)", children: new Map(), members, first: Math.min(...members) });
    nodes.push(...[...root.children.values()].filter((n) => n.children.size));
  } else nodes = [...root.children.values()];
  for (;;) {
    let best = null;
    for (const n of nodes) {
      if (n.children.size && n.members.length > 1 && (!best || n.members.length > best.members.length))
        best = n;
    }
    if (!best || nodes.length - 1 + best.children.size > MAX_GROUPS) break;
    nodes = nodes.flatMap((n) => (n === best ? [...n.children.values()] : [n]));
  }
  nodes.sort((a, b) => a.first - b.first);
  const names = nodes.map((n) => n.path);
  const members = nodes.map((n) => [...n.members].sort((a, b) => a - b));
  const byName = new Map(names.map((n, g) => [n, g]));
  const stacks = [];
  const walk = (node) => {
    if (isStack(node)) {
      const blocks = [...node.children.values()];
      const kinds = {};
      blocks.forEach((b, bi) => {
        for (const i of b.members) {
          const kind = params[i].slice(b.path.length + 1);
          if (!kinds[kind]) kinds[kind] = blocks.map(() => null);
          kinds[kind][bi] = i;
        }
      });
      const groups = blocks.map((b) => byName.get(b.path));
      stacks.push({
        name: node.path,
        groups: groups.every((g) => g !== undefined) ? groups : null,
        blocks: blocks.map((b) => b.path),
        kinds,
      });
    }
    for (const c of node.children.values()) walk(c);
  };
  walk(root);
  return { source: "tree", names, members, stacks };
}

/** The session's partition, or one built here when the server sends none. */
export function groupsFor(session, params) {
  const g = session && session.groups;
  if (g && Array.isArray(g.names) && Array.isArray(g.members)) return { stacks: [], ...g };
  return buildGroups(params);
}

function median(sorted) {
  return sorted.length ? sorted[(sorted.length - 1) >> 1] : null; // the lower median
}

/** A snapshot's `groups` computed from its full per-parameter lists (a server that sends none). */
export function aggregate(s, groups) {
  const out = Object.fromEntries(GROUP_KEYS.map((k) => [k, []]));
  const at = (key, i) => num((s[key] || [])[i]);
  for (const members of groups.members) {
    let sr = 0;
    let sf = 0;
    let ar = -Infinity;
    let af = -Infinity;
    let nan = 0;
    let inf = 0;
    let any = false;
    const norms = [];
    const ratios = [];
    for (const i of members) {
      const r = at("grad_norm_raw", i);
      if (r === null) continue;
      any = true;
      sr += r * r;
      const f = at("grad_norm", i);
      if (f !== null) sf += f * f;
      ar = Math.max(ar, at("grad_absmax_raw", i) ?? -Infinity);
      af = Math.max(af, at("grad_absmax", i) ?? -Infinity);
      nan += at("nan_count", i) || 0;
      inf += at("inf_count", i) || 0;
      norms.push(r);
      const u = at("update_ratio", i);
      if (u !== null) ratios.push(u);
    }
    norms.sort((a, b) => a - b);
    ratios.sort((a, b) => a - b);
    out.norm_raw.push(any ? Math.sqrt(sr) : null);
    out.norm.push(any ? Math.sqrt(sf) : null);
    out.absmax_raw.push(any && ar > -Infinity ? ar : null);
    out.absmax.push(any && af > -Infinity ? af : null);
    out.nan_count.push(any ? nan : null);
    out.inf_count.push(any ? inf : null);
    out.norm_min.push(norms.length ? norms[0] : null);
    out.norm_median.push(median(norms));
    out.norm_max.push(norms.length ? norms[norms.length - 1] : null);
    out.ratio_min.push(ratios.length ? ratios[0] : null);
    out.ratio_median.push(median(ratios));
    out.ratio_max.push(ratios.length ? ratios[ratios.length - 1] : null);
  }
  return out;
}

/** The longest dotted prefix every name shares ("" when none). */
export function commonPrefix(names) {
  if (!names.length) return "";
  let parts = names[0].split(".").slice(0, -1);
  for (const n of names) {
    const p = n.split(".");
    let k = 0;
    while (k < parts.length && k < p.length - 1 && parts[k] === p[k]) k++;
    parts = parts.slice(0, k);
  }
  return parts.join(".");
}

/**
 * What an expanded node shows, one level down: its modules (more than one tensor under one
 * dotted component) and its tensors, each {kind: "module"|"tensor", key, label, members}. A
 * node whose tensors all sit under one module shows that module's children instead.
 */
export function childrenOf(members, params) {
  if (members.length <= 1) return [];
  const prefix = commonPrefix(members.map((i) => params[i]));
  const cut = (i) => (prefix ? params[i].slice(prefix.length + 1) : params[i]);
  const byHead = new Map();
  for (const i of members) {
    const rest = cut(i);
    const dot = rest.indexOf(".");
    const head = dot < 0 ? rest : rest.slice(0, dot);
    if (!byHead.has(head)) byHead.set(head, { head, members: [], leaf: dot < 0 });
    byHead.get(head).members.push(i);
  }
  const out = [];
  for (const c of byHead.values()) {
    const path = prefix ? `${prefix}.${c.head}` : c.head;
    if (c.members.length === 1) {
      const i = c.members[0];
      out.push({ kind: "tensor", key: params[i], label: cut(i), members: [i] });
    } else {
      // a block of a stack reads better by its path ("layers.36") than by its number
      const label = /^\d+$/.test(c.head) ? path : c.head;
      out.push({ kind: "module", key: path, label, members: c.members });
    }
  }
  return out;
}

/**
 * A search over names: a glob (`*`, `?`, `[...]`: fnmatch's rule, case-sensitive, over the whole
 * name) when the query has one of those characters, else a case-insensitive substring. Returns
 * the matching indices, at most `limit`, and how many matched in all.
 */
export function searchNames(lower, names, query, limit = 50) {
  const q = query.trim();
  if (!q) return { indices: [], total: 0 };
  let test;
  if (/[*?[]/.test(q)) {
    const re = globRegExp(q);
    test = (i) => re.test(names[i]);
  } else {
    const sub = q.toLowerCase();
    test = (i) => lower[i].includes(sub);
  }
  const indices = [];
  let total = 0;
  for (let i = 0; i < names.length; i++) {
    if (!test(i)) continue;
    total++;
    if (indices.length < limit) indices.push(i);
  }
  return { indices, total };
}

/** fnmatch's translation of a glob: `*` any run, `?` one character, `[seq]`/`[!seq]` a class. */
export function globRegExp(glob) {
  let out = "";
  for (let k = 0; k < glob.length; k++) {
    const c = glob[k];
    if (c === "*") out += ".*";
    else if (c === "?") out += ".";
    else if (c === "[") {
      const end = glob.indexOf("]", k + 2);
      if (end < 0) out += "\\[";
      else {
        let set = glob.slice(k + 1, end).replace(/\\/g, "\\\\");
        if (set.startsWith("!")) set = `^${set.slice(1)}`;
        else if (set.startsWith("^")) set = `\\${set}`;
        out += `[${set}]`;
        k = end;
      }
    } else out += c.replace(/[.+^${}()|\\\]]/g, "\\$&");
  }
  return new RegExp(`^${out}$`, "s");
}

/** A short signature of a model's parameter names (the key pins are kept under). */
export function signature(params) {
  let h = 0x811c9dc5; // FNV-1a, 32 bits, over the names joined by newlines
  for (const name of params) {
    for (let k = 0; k < name.length; k++) {
      h ^= name.charCodeAt(k);
      h = Math.imul(h, 0x01000193) >>> 0;
    }
    h ^= 10;
    h = Math.imul(h, 0x01000193) >>> 0;
  }
  return `${params.length}-${h.toString(16)}`;
}

/**
 * "Representative layers": for each stack, its first, second, middle, second to last and last
 * blocks; returns the parameter indices of their tensors (every kind), ascending.
 */
export function representative(groups) {
  const out = new Set();
  for (const st of groups.stacks || []) {
    const n = st.blocks.length;
    const picks = new Set([0, 1, Math.floor((n - 1) / 2), n - 2, n - 1].filter((b) => b >= 0 && b < n));
    for (const list of Object.values(st.kinds || {}))
      for (const b of picks) if (list[b] !== null && list[b] !== undefined) out.add(list[b]);
  }
  return [...out].sort((a, b) => a - b);
}
