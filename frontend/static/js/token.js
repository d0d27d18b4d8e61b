// The sign-in box in the top bar: the pasted token goes to the server once (POST /api/v1/session), which answers
// with an HttpOnly session cookie; the page keeps nothing. "Sign out" drops the cookie.
import { session, signIn, signOut } from "./api.js";

async function refresh() {
  const status = document.getElementById("api-token-status");
  if (!status) return;
  const s = await session();
  status.textContent = s.authenticated ? `Signed in (${s.scope})` : "API token";
}

const form = document.getElementById("api-token-form");
if (form) {
  const input = document.getElementById("api-token-input");
  const message = document.getElementById("api-token-message");
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    message.textContent = "";
    try {
      await signIn(input.value);
      document.getElementById("api-token-box").open = false;
    } catch (e) {
      message.textContent = e.message;
    } finally {
      input.value = "";
    }
    refresh();
  });
  document.getElementById("api-token-clear").addEventListener("click", async () => {
    await signOut();
    refresh();
  });
}
refresh();
