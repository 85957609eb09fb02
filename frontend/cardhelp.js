// Each card's "?": a button in its header that opens a short note, what the card shows and how to
// read it, and the manual's page that says more (named as text: the page works with no internet).
// A card opts in with data-help="KEY" on its <article>; HELP holds the notes. One note is open at
// a time; Escape, a click elsewhere or the button again closes it, and focus goes back to the button.

export const HELP = {
  loss: {
    title: "Loss & global gradient norm",
    text:
      "The loss you record and the whole model's gradient norm per step: raw (as the backward left it, " +
      "before the hooks) and final (what the optimizer sees). Where they part, a hook or your loop " +
      "changed the gradients; markers are hook changes, NaN/Inf, spikes and rules firing.",
    doc: "docs/instruments.md#telemetry",
  },
  worst: {
    title: "Worst now",
    text:
      "The ten tensors whose newest raw gradient norm or update ratio is furthest from their own last " +
      "32 sampled values (a robust z-score), not the largest ones; a NaN or Inf ranks first, by origin " +
      "(the first tensor to go non-finite, then those that rose most before it). Click one " +
      "to open its group.",
    doc: "docs/large-models.md#large-models-hundreds-to-thousands-of-tensors",
  },
  heatmap: {
    title: "Gradient norm per parameter",
    text:
      "One row per parameter (per group in a large run), one column per sampled step, the colour the " +
      "log of its gradient's L2 norm. A row that turns bright or dark alone is the place to look; " +
      "raw / final: before or after the hooks.",
    doc: "docs/instruments.md#telemetry",
  },
  flow: {
    title: "Gradient flow",
    text:
      "The newest sampled step's gradient norm (or abs-max) per parameter, from input to output, log " +
      "scale: vanishing gradients fall towards the input, exploding ones climb.",
    doc: "docs/instruments.md#telemetry",
  },
  hist: {
    title: "Gradient histogram",
    text:
      "The distribution of one parameter's gradient values at the newest step with a histogram, raw " +
      "(before the hooks) and final (after them). Pick the parameter in the header.",
    doc: "docs/instruments.md#telemetry",
  },
  histtime: {
    title: "Histogram over steps",
    text:
      "The histogram card's parameter over the steps that have a histogram, as quantile bands " +
      "(TensorBoard's distributions: min-max, 7-93 %, 16-84 %, 31-69 % and the median), raw or final. " +
      "Bands that widen are a gradient spreading out.",
    doc: "docs/instruments.md#telemetry",
  },
  ratio: {
    title: "Update / parameter ratio",
    text:
      "How far each step moved each parameter relative to its size, ‖Δθ‖/‖θ‖, log scale. A parameter " +
      "far above the others moves fastest; one that drops to zero is not being updated (frozen).",
    doc: "docs/instruments.md#telemetry",
  },
  effects: {
    title: "Hook effects",
    text:
      "Per hook and sampled step: the norm after over the norm before on its targets, and the elements " +
      "it changed. A ratio of 1 and nothing changed means the hook did nothing that step.",
    doc: "docs/hooks.md#hook-kinds",
  },
  ranks: {
    title: "Ranks",
    text:
      "Under DDP or FSDP2, each rank's own gradient norm before the reduction. One rank apart from the " +
      "others points at its data or its device.",
    doc: "docs/distributed.md#distributed-training-ddp-and-fsdp2-under-torchrun",
  },
  modules: {
    title: "Module gradients",
    text:
      "For each module a module_log hook watches: the norm of the gradient flowing out of it " +
      "(grad_output, and grad_input when asked) over steps, log scale.",
    doc: "docs/instruments.md#telemetry",
  },
  paramstats: {
    title: "Parameter statistics",
    text:
      "Mean, std, abs-max, norms raw and final, NaN/Inf counts and update ratio of the parameters you " +
      "pick (click a chart or a row, or filter by name) over steps, and a table of the newest sampled step.",
    doc: "docs/instruments.md#telemetry",
  },
  optim: {
    title: "Optimizer",
    text:
      "What the newest step did with the gradient: the effective step ‖Δθ‖/‖g‖, the cosines between the " +
      "update, the gradient and the previous gradient, and for Adam its moments and the share of v below eps².",
    doc: "docs/instruments.md#optimizer-state-and-update-geometry",
  },
  optimtime: {
    title: "Optimizer over steps",
    text:
      "The Optimizer card's figures for the whole model over the sampled steps. cos(g, g_prev) near 1: " +
      "consistent gradients; near 0 or negative: noise or oscillation. A high share below eps²: eps, " +
      "not the gradient, sets Adam's step.",
    doc: "docs/instruments.md#optimizer-state-and-update-geometry",
  },
  noise: {
    title: "Noise scale",
    text:
      "B_simple = tr(Σ)/|G|², roughly the batch size beyond which a larger batch stops buying fewer " +
      "steps (the critical batch size), beside the batch in use. It needs two batch sizes per step " +
      "(micro-batches or DDP ranks); without them the card says why there is no estimate.",
    doc: "docs/instruments.md#gradient-noise-scale",
  },
  flight: {
    title: "Recent steps (flight recorder)",
    text:
      "Every step's loss and gradient norms (raw and final) from a ring of the last steps, read around " +
      "a spike or a NaN/Inf, or when you ask: the steps the sampled charts skip.",
    doc: "docs/instruments.md#spikes-and-the-flight-recorder",
  },
  hooks: {
    title: "Hooks",
    text:
      "The hooks in force, in the order they run, each with its target, point and parameters: edit, " +
      "disable or remove one and it applies at the next step boundary. Below, add one.",
    doc: "docs/hooks.md#hook-kinds",
  },
  rules: {
    title: "Rules",
    text:
      "“When SIGNAL OP THRESHOLD [for K steps] then ACTION”, checked at every step boundary: each row " +
      "is a rule, whether it is enabled, how often it fired and what its last firing did.",
    doc: "docs/rules-and-agents.md#unattended-runs-rules",
  },
  events: {
    title: "Events",
    text:
      "What happened, newest first: hook changes, NaN/Inf, hook errors, skipped steps, rewinds, the " +
      "agent's commands (an agent badge), server errors and this page's connection. The run's history " +
      "keeps them.",
    doc: "docs/history.md#history-replay-and-export",
  },
};

let open = null; // {button, pop} of the note shown now

function close(focus) {
  if (!open) return;
  open.pop.hidden = true;
  open.button.setAttribute("aria-expanded", "false");
  if (focus) open.button.focus();
  open = null;
}

function place(button, pop) {
  // fixed, below the button (above it where the window has no room), inside the window
  const margin = 8;
  const r = button.getBoundingClientRect();
  pop.style.maxWidth = `${Math.min(340, window.innerWidth - 2 * margin)}px`;
  const w = pop.offsetWidth;
  const h = pop.offsetHeight;
  const left = Math.max(margin, Math.min(r.left, window.innerWidth - w - margin));
  let top = r.bottom + 6;
  if (top + h > window.innerHeight - margin) top = Math.max(margin, r.top - h - 6);
  pop.style.left = `${left}px`;
  pop.style.top = `${top}px`;
}

function show(button, pop) {
  close(false);
  pop.hidden = false;
  button.setAttribute("aria-expanded", "true");
  place(button, pop);
  open = { button, pop };
}

/** Give every card with data-help its "?" button and note. */
export function installCardHelp(root = document) {
  for (const card of root.querySelectorAll("article.card[data-help]")) {
    const key = card.dataset.help;
    const help = HELP[key];
    const head = card.querySelector(".card-head");
    if (!help || !head || head.querySelector(".help-btn")) continue;
    const button = document.createElement("button");
    button.type = "button";
    button.className = "help-btn";
    button.textContent = "?";
    button.dataset.testid = `help-${key}`;
    button.setAttribute("aria-label", `About this card: ${help.title}`);
    button.setAttribute("aria-expanded", "false");
    button.setAttribute("aria-controls", `help-${key}-note`);
    const pop = document.createElement("div");
    pop.className = "help-pop";
    pop.id = `help-${key}-note`;
    pop.setAttribute("role", "tooltip");
    pop.dataset.testid = `help-note-${key}`;
    pop.hidden = true;
    const text = document.createElement("p");
    text.textContent = help.text;
    const doc = document.createElement("p");
    doc.className = "help-doc";
    doc.append("Manual: ");
    const code = document.createElement("code");
    code.textContent = help.doc;
    doc.append(code);
    pop.append(text, doc);
    button.addEventListener("click", (e) => {
      e.stopPropagation();
      if (open && open.pop === pop) close(true);
      else show(button, pop);
    });
    pop.addEventListener("click", (e) => e.stopPropagation());
    const h2 = head.querySelector("h2");
    if (h2) h2.after(button);
    else head.prepend(button);
    document.body.append(pop);
  }
  document.addEventListener("keydown", (e) => {
    if (e.key === "Escape" && open) close(true);
  });
  document.addEventListener("click", () => close(false));
  window.addEventListener("resize", () => close(false));
  window.addEventListener("scroll", () => open && place(open.button, open.pop), true);
}
