// The API token box in the top bar: paste once, kept in localStorage, sent on every write.
import { getToken, setToken } from "./api.js";

function refresh() {
  const status = document.getElementById("api-token-status");
  if (status) status.textContent = getToken() ? "API token ✓" : "API token";
}

const form = document.getElementById("api-token-form");
if (form) {
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    setToken(document.getElementById("api-token-input").value);
    document.getElementById("api-token-input").value = "";
    document.getElementById("api-token-box").open = false;
    refresh();
  });
  document.getElementById("api-token-clear").addEventListener("click", () => {
    setToken("");
    refresh();
  });
}
refresh();
