// Cues on the page (docs/cues.md): the stream's cue list (GET/PUT /api/streams/<id>/cues with the
// owner token), a cue added from the page's current prompt and noise, the set saved to and loaded from
// a file, and firing by button or by the keys 1-9 (cues 1-9) with {"type": "cue"} on the control path.

const TEXT_FIELDS = new Set(["INPUT", "TEXTAREA", "SELECT"]);

export function setupCues({ $, notice }) {
  let connection = null;
  let cues = [];

  const owner = () => ({ Authorization: `Bearer ${connection.ownerToken}`, "Content-Type": "application/json" });
  const url = () => `/api/streams/${connection.streamId}/cues`;

  function fire(cue) {
    if (connection) connection.send({ type: "cue", name: cue.name });
  }

  function show() {
    const list = $("cue-list");
    list.replaceChildren();
    cues.forEach((cue, i) => {
      const entry = document.createElement("li");
      const button = document.createElement("button");
      button.type = "button";
      button.textContent = i < 9 ? `${i + 1} · ${cue.name}` : cue.name;
      button.title = `${[].concat(cue.prompt).join(" + ")} over ${cue.transition_s || 0} s`;
      button.addEventListener("click", () => fire(cue));
      entry.append(button);
      list.append(entry);
    });
  }

  // The server checks the whole set and keeps the old one when it refuses: the page shows its reason.
  async function put(next) {
    if (!connection || !connection.ownerToken) return;
    const response = await fetch(url(), { method: "PUT", headers: owner(), body: JSON.stringify({ cues: next }) });
    const body = await response.json();
    if (!response.ok) {
      notice(`Cues not saved: ${body.detail}`);
      return;
    }
    cues = body.cues;
    show();
  }

  $("cue-add").addEventListener("click", () => {
    const name = $("cue-name").value.trim();
    const cue = { name, prompt: $("prompt").value, noise_scale: Number($("noise").value),
                  transition_s: Number($("cue-seconds").value) };
    put([...cues.filter((c) => c.name !== name), cue]);
  });

  $("cue-save").addEventListener("click", () => {
    const link = document.createElement("a");
    link.href = URL.createObjectURL(new Blob([JSON.stringify({ cues }, null, 2)], { type: "application/json" }));
    link.download = "diffcast-cues.json";
    link.click();
    URL.revokeObjectURL(link.href);
  });

  $("cue-load").addEventListener("change", async () => {
    const file = $("cue-load").files[0];
    if (!file) return;
    try {
      put(JSON.parse(await file.text()).cues);
    } catch (error) {
      notice(`Cues not loaded: ${error.message}`);
    }
    $("cue-load").value = "";
  });

  // Keys fire cues only where typing cannot mean text: a "3" in the prompt box is a 3.
  document.addEventListener("keydown", (event) => {
    const target = event.target;
    if (TEXT_FIELDS.has(target.tagName) || target.isContentEditable) return;
    if (event.ctrlKey || event.metaKey || event.altKey) return;
    const index = "123456789".indexOf(event.key);
    if (index >= 0 && index < cues.length) fire(cues[index]);
  });

  return {
    connected(next) {
      connection = next;
      for (const id of ["cue-add", "cue-save", "cue-load"]) $(id).disabled = !connection.ownerToken;
      // A new stream starts without cues: the set the page holds (added or loaded earlier) goes to it.
      if (cues.length) put(cues);
    },
    disconnected() {
      connection = null;
      for (const id of ["cue-add", "cue-save", "cue-load"]) $(id).disabled = true;
    },
  };
}
