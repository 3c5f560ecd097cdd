// The two DOM helpers the page's modules share.

export const $ = (id) => document.getElementById(id);

// An element with its text (never parsed as markup) and attributes.
export function el(tag, text = "", attrs = {}) {
  const node = document.createElement(tag);
  node.textContent = text;
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  return node;
}
