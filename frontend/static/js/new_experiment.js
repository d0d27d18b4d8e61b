// Submission form: builds the POST /api/v1/experiments body, checks what the browser can check, and
// shows the server's 4xx message verbatim when the server disagrees.
import { post } from "./api.js";

const form = document.getElementById("experiment-form");
const errorBox = document.getElementById("form-error");
const preview = document.getElementById("request-preview");
const BASELINE = "bf16";

class FormError extends Error {
  constructor(field, message) {
    super(message);
    this.field = field;
  }
}

function value(name) {
  const el = form.elements.namedItem(name);
  return el ? String(el.value).trim() : "";
}

function integer(name, label, { min = 0, optional = false } = {}) {
  const raw = value(name);
  if (raw === "" && optional) return null;
  const n = Number(raw);
  if (raw === "" || !Number.isInteger(n) || n < min) {
    throw new FormError(name, `${label} must be a whole number ≥ ${min} (got "${raw}")`);
  }
  return n;
}

function checked(name) {
  return form.querySelector(`input[name="${name}"]:checked`)?.value;
}

export function buildRequest() {
  const name = value("name");
  if (!name) throw new FormError("name", "Name is required: give the experiment a short name you will recognise");

  const vocabSize = integer("vocab_size", "Vocabulary size", { min: 1 });
  let model;
  if (checked("model_kind") === "custom") {
    model = {
      hidden_size: integer("hidden_size", "hidden_size", { min: 1 }),
      intermediate_size: integer("intermediate_size", "intermediate_size", { min: 1 }),
      num_hidden_layers: integer("num_hidden_layers", "num_hidden_layers", { min: 1 }),
      num_attention_heads: integer("num_attention_heads", "num_attention_heads", { min: 1 }),
      num_key_value_heads: integer("num_key_value_heads", "num_key_value_heads", { min: 1 }),
      head_dim: integer("head_dim", "head_dim", { min: 1, optional: true }),
      vocab_size: vocabSize,
    };
  } else {
    model = value("preset");
  }

  const corpus = value("corpus");
  if (!corpus) throw new FormError("corpus", "Corpus is required: a directory name under PLAB_DATA_DIR or an absolute path");
  const data = { corpus, vocab_size: vocabSize, seq_len: integer("seq_len", "Sequence length", { min: 1 }) };

  const byTokens = checked("budget_kind") === "tokens";
  const lr = Number(value("lr"));
  if (value("lr") === "" || !Number.isFinite(lr) || lr <= 0) {
    throw new FormError("lr", `Learning rate must be a positive number (got "${value("lr")}")`);
  }
  const training = {
    steps: byTokens ? null : integer("steps", "Steps", { min: 1 }),
    tokens: byTokens ? integer("tokens", "Tokens", { min: 1 }) : null,
    batch_size: integer("batch_size", "Batch size", { min: 1 }),
    lr,
    warmup_steps: integer("warmup_steps", "Warm-up steps"),
  };

  const first = integer("bf16_first_layers", "BF16 first layers");
  const last = integer("bf16_last_layers", "BF16 last layers");
  const recipe = (r, lastLayers = last) => ((first || lastLayers)
    ? { name: r, bf16_first_layers: first, bf16_last_layers: lastLayers } : r);
  const chosen = [...form.querySelectorAll('input[name="recipes"]:checked')]
    .map((el) => el.value).filter((r) => r !== BASELINE);
  const recipes = [BASELINE, ...chosen.map((r) => recipe(r))];

  if (form.elements.namedItem("ablation").checked) {
    const ablationRecipe = value("ablation_recipe");
    const raw = value("ablation_values");
    const values = raw.split(/[\s,]+/).filter(Boolean).map(Number);
    if (!values.length || values.some((v) => !Number.isInteger(v) || v < 0)) {
      throw new FormError("ablation_values",
        `Ablation values must be whole numbers ≥ 0 separated by commas, e.g. "0, 2, 4, 8" (got "${raw}")`);
    }
    for (const v of [...new Set(values)]) {
      // The plain recipe row already covers this layer count: do not train the same run twice.
      if (chosen.includes(ablationRecipe) && v === last) continue;
      recipes.push({ name: ablationRecipe, bf16_first_layers: first, bf16_last_layers: v });
    }
  }

  const evalTasks = value("eval_tasks").split(/[\s,]+/).filter(Boolean);
  const replicates = integer("replicates", "Seed replicates", { min: 1 });
  if (replicates > 16) throw new FormError("replicates", `Seed replicates: at most 16 (got ${replicates})`);
  const tolerance = Number(value("verdict_tolerance_pct"));
  if (!Number.isFinite(tolerance) || tolerance <= 0 || tolerance > 100) {
    throw new FormError("verdict_tolerance_pct",
      `Verdict tolerance must be a percentage above 0 and at most 100, e.g. 1 (got "${value("verdict_tolerance_pct")}")`);
  }
  const seeds = replicates > 1
    ? { replicates, replicate: form.elements.namedItem("replicate_all").checked ? "all" : "baseline" } : {};
  return {
    name,
    description: value("description"),
    model,
    data,
    training,
    seed: integer("seed", "Seed"),
    recipes,
    eval_tasks: evalTasks,
    ...seeds,
    verdict_tolerance_pct: tolerance,
    enqueue: form.elements.namedItem("enqueue").checked,
  };
}

function showError(message, field) {
  errorBox.textContent = message;
  errorBox.hidden = !message;
  form.querySelectorAll(".invalid").forEach((el) => el.classList.remove("invalid"));
  if (field) {
    const el = form.elements.namedItem(field);
    if (el && el.classList) {
      el.classList.add("invalid");
      el.focus();
    }
  }
}

function syncVisibility() {
  const custom = checked("model_kind") === "custom";
  document.getElementById("custom-dims").hidden = !custom;
  document.getElementById("preset-row").hidden = custom;
  const byTokens = checked("budget_kind") === "tokens";
  document.getElementById("steps-row").hidden = byTokens;
  document.getElementById("tokens-row").hidden = !byTokens;
}

function updatePreview() {
  try {
    preview.textContent = JSON.stringify(buildRequest(), null, 2);
  } catch (err) {
    preview.textContent = `(incomplete: ${err.message})`;
  }
}

form.addEventListener("change", () => { syncVisibility(); updatePreview(); });
form.addEventListener("input", updatePreview);
form.addEventListener("submit", async (event) => {
  event.preventDefault();
  let body;
  try {
    body = buildRequest();
  } catch (err) {
    showError(err.message, err.field);
    return;
  }
  const button = document.getElementById("experiment-submit");
  button.disabled = true;
  showError("");
  try {
    const experiment = await post("/api/v1/experiments", body);
    window.location.assign(`/experiments/${encodeURIComponent(experiment.id)}`);
  } catch (err) {
    showError(err.message);
    button.disabled = false;
  }
});
syncVisibility();
updatePreview();
