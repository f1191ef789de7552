// Stats display shared by the page and the playground widget: one server stats message -> the
// text of the six stat cells (output fps, latency, playout slack, fidelity, dropped, frames shown).
const fmt = (value, unit, digits = 0) => (value === null || value === undefined ? "–" : `${Number(value).toFixed(digits)} ${unit}`);

export function statCells(stats) {
  // Under the slack policy the server adds the stream's tier and the fidelity its last chunk ran at.
  const live = stats.fidelity_steps ? `${stats.fidelity_steps} of ${stats.steps} steps · window ${stats.kv_window} · ${stats.precision}`
    : `${stats.steps} steps`;
  return {
    fps: fmt(stats.fps, "fps", 1),
    latency: stats.latency_ms === null ? "–" : `${fmt(stats.latency_p50_ms, "ms")} (p95 ${fmt(stats.latency_p95_ms, "ms")})`,
    slack: fmt(stats.slack_s * 1000, "ms") + (stats.tier ? ` · ${stats.tier}` : ""),
    fidelity: `${live} · noise ${Number(stats.noise_scale).toFixed(2)}`,
    dropped: String(stats.dropped_frames),
    frames: String(stats.frames_out),
  };
}
